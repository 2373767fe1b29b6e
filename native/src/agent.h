// NativeAgent: one NIXL agent, exposed to JS as an ObjectWrap with promise-returning methods.
//
// Threading (see docs/native.md "Threads"):
// - The NIXL agent is created with sync mode NONE by default, so it takes no locks of its
//   own. Every call into it goes through `nixl_mu_`, from either a libuv worker (one-shot
//   calls) or the agent's poll thread; calls are therefore serialized. The poll thread takes
//   the lock per step (one create+post, one pass of status polls, one notification drain),
//   never across its wait, so one-shot calls and cancels interleave with a busy poll thread.
// - The poll thread owns every transfer from create to release (poller.cc): it posts, polls
//   get_xfer_status, enforces the addon's own deadline (NIXL has none) and drains
//   notifications. Results reach JS through one ThreadSafeFunction.
// - Aborts are quiescent: a canceled or timed-out request is never released while NIXL still
//   reports it in progress, because releasing does not stop a UCX get (docs/native.md).
// - The JS thread never calls NIXL.
#pragma once

#include <napi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common.h"
#include "nixl_api.h"

namespace hnx {

class NativeAgent;
struct SymbolTable;

using Clock = std::chrono::steady_clock;

Failure AgentClosed();

// Something the poll thread hands to the JS thread.
struct Event {
  enum Kind { kReadSettled, kNotification, kQuiesced } kind = kReadSettled;
  // kReadSettled
  std::unique_ptr<Napi::Promise::Deferred> deferred;
  std::optional<Failure> failure;
  double bytes = 0;
  double micros = 0;  // post to observed completion, measured on the poll thread
  // kNotification
  std::string peer;
  std::string message;
  // kQuiesced: a read that settled as tainted is now confirmed done (or the agent is gone)
  uint32_t id = 0;
};

// Lives as long as the ThreadSafeFunction; `owner` is cleared when the NativeAgent dies so
// late events never touch a freed object. JS thread only.
struct Bridge {
  NativeAgent* owner = nullptr;
};

void DispatchEvent(Napi::Env env, Napi::Function on_event, Bridge* bridge, Event* event);
void FinalizeBridge(Napi::Env env, void* unused, Bridge* bridge);
using EventTsfn = Napi::TypedThreadSafeFunction<Bridge, Event, DispatchEvent>;

// A READ from submission to quiescence. Descriptor arrays are (addr, len, devId) triples, or
// indices into prepared lists.
struct PendingRead {
  uint32_t id = 0;
  std::string peer;
  MemType local_kind = kMemDram;
  MemType remote_kind = kMemDram;
  std::vector<uint64_t> local;
  std::vector<uint64_t> remote;
  // Prepared form: list ids (prepList) and indices; used when prepared is true.
  bool prepared = false;
  uint32_t local_list_id = 0;
  uint32_t remote_list_id = 0;
  std::vector<int> local_idx;
  std::vector<int> remote_idx;
  std::optional<std::string> notif;
  Clock::time_point deadline;
  Clock::time_point posted_at;
  uint64_t bytes = 0;
  std::unique_ptr<Napi::Promise::Deferred> deferred;
  // Why the read is being aborted (cancel, deadline, close), once it is; the request is
  // still polled until NIXL reports it done.
  std::optional<Failure> abort;
  Clock::time_point abort_at;
  // Settled as NAT_ERR_XFER_TAINTED: JS has its rejection; a kQuiesced event follows once
  // NIXL reports the request done.
  bool tainted = false;
  // The peer was invalidated under a tainted request: its status can no longer be asked
  // (NIXL answers NOT_FOUND without asking UCX), so it is kept until the agent is destroyed.
  bool orphaned = false;
  // NIXL handles, created and released on the poll thread under nixl_mu_.
  XferDlist local_list = nullptr;
  XferDlist remote_list = nullptr;
  OptArgs opt = nullptr;
  XferReq req = nullptr;
};

class NativeAgent : public Napi::ObjectWrap<NativeAgent> {
 public:
  static Napi::Function Init(Napi::Env env);
  explicit NativeAgent(const Napi::CallbackInfo& info);
  ~NativeAgent() override;

  // Called by DispatchEvent on the JS thread after a read promise settled.
  void ReadSettled(Napi::Env env);

 private:
  Napi::Value Create(const Napi::CallbackInfo& info);
  Napi::Value ListPlugins(const Napi::CallbackInfo& info);
  Napi::Value PluginParams(const Napi::CallbackInfo& info);
  Napi::Value CreateBackend(const Napi::CallbackInfo& info);
  Napi::Value RegisterMem(const Napi::CallbackInfo& info);
  Napi::Value DeregisterMem(const Napi::CallbackInfo& info);
  Napi::Value LocalMetadata(const Napi::CallbackInfo& info);
  Napi::Value LoadRemoteMetadata(const Napi::CallbackInfo& info);
  Napi::Value InvalidatePeer(const Napi::CallbackInfo& info);
  Napi::Value CheckPeer(const Napi::CallbackInfo& info);
  Napi::Value GenNotif(const Napi::CallbackInfo& info);
  Napi::Value PrepList(const Napi::CallbackInfo& info);
  Napi::Value ReleaseList(const Napi::CallbackInfo& info);
  Napi::Value Read(const Napi::CallbackInfo& info);
  Napi::Value ReadPrepared(const Napi::CallbackInfo& info);
  Napi::Value Cancel(const Napi::CallbackInfo& info);
  Napi::Value Stats(const Napi::CallbackInfo& info);
  Napi::Value Close(const Napi::CallbackInfo& info);

  Napi::Value MemoryCall(const Napi::CallbackInfo& info, bool do_register);
  // The shape every one-shot NIXL call but create shares, prologue included: a rejected
  // promise after close() or before NIXL is loaded; otherwise `body` runs on a libuv worker
  // under nixl_mu_, and only while the NIXL agent exists (NAT_ERR_AGENT_CLOSED otherwise).
  using LockedFn = std::function<std::optional<Failure>(const SymbolTable& api)>;
  Napi::Promise RunLocked(Napi::Env env, const char* name, LockedFn body, OneShot::ResolveFn resolve);
  // Why a call cannot run now (closed, or NIXL not loaded), if it cannot.
  std::optional<Failure> Unusable() const;
  // Common tail of Read and ReadPrepared: deadline, promise, keep-alive, queueing.
  Napi::Value Submit(Napi::Env env, std::unique_ptr<PendingRead> r, double timeout_ms);

  // poller.cc
  void PollLoop();
  // Creates and posts one read; false once it settled (failed, or finished inline).
  bool StartRead(PendingRead& r, std::vector<Event*>& out);
  // One status poll; true once the read settled for good (quiescent).
  bool PollRead(PendingRead& r, Clock::time_point now, std::vector<Event*>& out);
  void Settle(PendingRead& r, std::optional<Failure> failure, std::vector<Event*>& out);
  Failure ClassifyXferError(const char* op, Status status, const std::string& peer);
  void ReleaseHandles(PendingRead& r);
  void DrainNotifications(std::vector<Event*>& out);
  void Emit(std::vector<Event*>& out);
  // Stops the poll thread and destroys the NIXL agent. Safe to call twice; any thread.
  void Shutdown();

  EventTsfn tsfn_;
  bool tsfn_released_ = false;  // JS thread only
  // Cleared by the function's finalizer, which may run before or after this object dies;
  // whichever goes first unhooks itself from the other. JS thread only.
  Bridge* bridge_ = nullptr;

  friend void FinalizeBridge(Napi::Env env, void* unused, Bridge* bridge);
  uint32_t pending_reads_ = 0;  // JS thread only: promises not yet settled

  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> probes_sent_{0};
  std::atomic<uint64_t> notif_errors_{0};
  std::atomic<uint64_t> tainted_total_{0};

  // Everything below that holds NIXL state is guarded by nixl_mu_.
  std::mutex nixl_mu_;
  Agent agent_ = nullptr;
  std::vector<Backend> backends_;
  NotifMap notif_map_ = nullptr;
  std::set<std::string> peers_;        // peers whose metadata this agent loaded
  std::set<std::string> probe_peers_;  // those that advertised the disconnect probe
  std::map<uint32_t, XferDlistHandle> lists_;  // prepared descriptor lists by id
  uint32_t next_list_id_ = 1;
  // Posted requests, from post to quiescence (tainted and orphaned ones included). Owned by
  // the poll thread; one-shot calls only read them (InvalidatePeer) under nixl_mu_.
  std::vector<std::unique_ptr<PendingRead>> active_;
  std::string name_;

  std::thread poller_;  // assigned under nixl_mu_ before closed_ can be observed
  std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<std::unique_ptr<PendingRead>> queue_;
  std::vector<uint32_t> cancels_;
  bool stopping_ = false;
  std::chrono::microseconds busy_poll_{50};
  std::chrono::microseconds idle_poll_{1000};
  // How long an aborted request may stay in progress before the read settles as tainted.
  std::chrono::milliseconds quiesce_{5000};
};

}  // namespace hnx
