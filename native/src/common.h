// Coded failures and the one-shot Promise worker shared by the addon's classes.
#pragma once

#include <napi.h>

#include <functional>
#include <optional>
#include <string>

#include "nixl_api.h"

namespace hnx {

// A failure produced on a worker thread: plain data, turned into a JS Error on the JS thread.
// `code` is one of the NAT_ERR_* codes of native/errors.ts; the TS gate maps it to its class.
struct Failure {
  std::string code;
  std::string message;
  std::string op;    // the nixl_capi_* call that failed, if any
  std::string peer;  // the remote agent involved, if any
  int status = 0;    // raw C status (nixl_capi_status_t); meaningful when has_status
  bool has_status = false;
};

// Maps a C status to the addon's code. Values the loaded version does not define become
// NAT_ERR_NIXL_UNKNOWN_STATUS; the raw number is always kept.
Failure StatusFailure(const char* op, Status status, const std::string& peer = std::string());

Failure MakeFailure(const char* code, std::string message);

Napi::Error ToJsError(Napi::Env env, const Failure& failure);

// True once the process emitted 'exit' (addon.cc subscribes at load): finalizers that run
// during environment teardown must then leave Node's handles alone.
bool ProcessExiting();
void MarkProcessExiting();

// A TypeError with code NAT_ERR_INVALID_ARG, thrown on the JS thread for a bad argument.
Napi::Error ArgError(Napi::Env env, const std::string& message);

// One-shot call: `exec` runs on a libuv worker thread and must touch no napi value; `resolve`
// builds the result on the JS thread. Inputs are captured by value when the worker is made.
class OneShot : public Napi::AsyncWorker {
 public:
  using ExecFn = std::function<std::optional<Failure>()>;
  using ResolveFn = std::function<Napi::Value(Napi::Env)>;

  // Queues the work and returns its promise. `owner` is kept referenced until completion so
  // the native object it wraps cannot be collected under a running worker.
  static Napi::Promise Run(Napi::Env env, Napi::Object owner, const char* name, ExecFn exec,
                           ResolveFn resolve);

 protected:
  void Execute() override;
  void OnOK() override;
  void OnError(const Napi::Error& error) override;

 private:
  OneShot(Napi::Env env, Napi::Object owner, const char* name, ExecFn exec, ResolveFn resolve);

  Napi::Promise::Deferred deferred_;
  Napi::ObjectReference owner_;
  ExecFn exec_;
  ResolveFn resolve_;
  std::optional<Failure> failure_;
};

}  // namespace hnx
