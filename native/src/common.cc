#include "common.h"

#include <atomic>

namespace hnx {
namespace {
std::atomic<bool> g_exiting{false};
}  // namespace

bool ProcessExiting() { return g_exiting.load(); }
void MarkProcessExiting() { g_exiting = true; }

Failure StatusFailure(const char* op, Status status, const std::string& peer) {
  Failure f;
  f.op = op;
  f.peer = peer;
  f.status = static_cast<int>(status);
  f.has_status = true;
  switch (status) {
    case kErrInvalidParam:
      f.code = "NAT_ERR_NIXL_INVALID_PARAM";
      break;
    case kErrBackend:
      f.code = "NAT_ERR_NIXL_BACKEND";
      break;
    case kErrInvalidState:
      f.code = "NAT_ERR_NIXL_INVALID_STATE";
      break;
    case kErrException:
      f.code = "NAT_ERR_NIXL_EXCEPTION";
      break;
    case kErrNotFound:
      f.code = "NAT_ERR_NIXL_NOT_FOUND";
      break;
    default:
      // Includes NO_TELEMETRY (never expected here) and codes newer than this addon.
      f.code = "NAT_ERR_NIXL_UNKNOWN_STATUS";
      break;
  }
  f.message = std::string("nixl_capi_") + op + " returned " + std::to_string(f.status);
  if (!peer.empty()) f.message += " (peer " + peer + ")";
  return f;
}

Failure MakeFailure(const char* code, std::string message) {
  Failure f;
  f.code = code;
  f.message = std::move(message);
  return f;
}

Napi::Error ToJsError(Napi::Env env, const Failure& failure) {
  Napi::Error err = Napi::Error::New(env, failure.message);
  err.Set("code", Napi::String::New(env, failure.code));
  if (failure.has_status) err.Set("nixlStatus", Napi::Number::New(env, failure.status));
  if (!failure.op.empty()) err.Set("nixlOp", Napi::String::New(env, "nixl_capi_" + failure.op));
  if (!failure.peer.empty()) err.Set("peer", Napi::String::New(env, failure.peer));
  return err;
}

Napi::Error ArgError(Napi::Env env, const std::string& message) {
  Napi::Error err = Napi::TypeError::New(env, message);
  err.Set("code", Napi::String::New(env, "NAT_ERR_INVALID_ARG"));
  return err;
}

OneShot::OneShot(Napi::Env env, Napi::Object owner, const char* name, ExecFn exec,
                 ResolveFn resolve)
    : Napi::AsyncWorker(env, name),
      deferred_(Napi::Promise::Deferred::New(env)),
      owner_(Napi::Persistent(owner)),
      exec_(std::move(exec)),
      resolve_(std::move(resolve)) {}

Napi::Promise OneShot::Run(Napi::Env env, Napi::Object owner, const char* name, ExecFn exec,
                           ResolveFn resolve) {
  auto* worker = new OneShot(env, owner, name, std::move(exec), std::move(resolve));
  Napi::Promise promise = worker->deferred_.Promise();
  worker->Queue();  // deletes itself on the JS thread after OnOK/OnError
  return promise;
}

void OneShot::Execute() {
  try {
    failure_ = exec_();
  } catch (const std::exception& e) {
    // NIXL's C layer catches its own exceptions; this covers allocation failures here.
    failure_ = MakeFailure("NAT_ERR_NIXL_EXCEPTION", e.what());
  }
}

void OneShot::OnOK() {
  Napi::Env env = Env();
  if (failure_) {
    deferred_.Reject(ToJsError(env, *failure_).Value());
    return;
  }
  deferred_.Resolve(resolve_ ? resolve_(env) : env.Undefined());
}

void OneShot::OnError(const Napi::Error& error) { deferred_.Reject(error.Value()); }

}  // namespace hnx
