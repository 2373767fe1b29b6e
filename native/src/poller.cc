// The per-agent poll thread: posts READs, polls them to quiescence, enforces deadlines and
// cancels, classifies failures and drains notifications. See agent.h for the locking rules.
#include <algorithm>
#include <cstring>
#include <utility>

#include "agent.h"
#include "nixl_loader.h"

namespace hnx {
namespace {

// Liveness probe sent after an ambiguous transfer failure (ClassifyXferError), only to peers
// that advertised it. It starts with a NUL byte so no application message collides with it;
// receiving addons drop it.
constexpr char kProbeNotif[] = "\0handoff-nixl-probe";
constexpr size_t kProbeNotifLen = sizeof(kProbeNotif) - 1;

bool Contains(const std::vector<uint32_t>& ids, uint32_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

}  // namespace

void NativeAgent::PollLoop() {
  std::vector<Event*> out;
  std::vector<uint32_t> cancels;  // ids canceled and not yet matched; kept one pass
  for (;;) {
    std::deque<std::unique_ptr<PendingRead>> incoming;
    bool stop = false;
    bool busy = false;
    {
      std::lock_guard<std::mutex> lock(nixl_mu_);
      busy = !active_.empty();
    }
    {
      std::unique_lock<std::mutex> lock(q_mu_);
      q_cv_.wait_for(lock, busy ? busy_poll_ : idle_poll_,
                     [this] { return stopping_ || !queue_.empty() || !cancels_.empty(); });
      incoming.swap(queue_);
      cancels.insert(cancels.end(), cancels_.begin(), cancels_.end());
      cancels_.clear();
      stop = stopping_;
    }

    // Start new reads one at a time, each under its own short hold of nixl_mu_ (a CMA post
    // copies synchronously), and look for a cancel right before each post: a read canceled
    // before it was posted is never posted.
    for (auto& r : incoming) {
      {
        std::lock_guard<std::mutex> lock(q_mu_);
        cancels.insert(cancels.end(), cancels_.begin(), cancels_.end());
        cancels_.clear();
        stop = stop || stopping_;
      }
      if (stop) {
        Settle(*r, MakeFailure("NAT_ERR_AGENT_CLOSED", "the NIXL agent was closed before the read was posted"), out);
        continue;
      }
      if (Contains(cancels, r->id)) {
        Settle(*r, MakeFailure("NAT_ERR_XFER_CANCELED", "the read was canceled before it was posted"), out);
        continue;
      }
      std::lock_guard<std::mutex> lock(nixl_mu_);
      if (StartRead(*r, out)) active_.push_back(std::move(r));
    }

    {
      std::lock_guard<std::mutex> lock(nixl_mu_);
      const Clock::time_point now = Clock::now();
      for (size_t i = 0; i < active_.size();) {
        PendingRead& r = *active_[i];
        if (!r.abort && !r.tainted) {
          if (stop) {
            r.abort = MakeFailure("NAT_ERR_AGENT_CLOSED", "the NIXL agent was closed during the read");
          } else if (Contains(cancels, r.id)) {
            r.abort = MakeFailure("NAT_ERR_XFER_CANCELED", "the read was canceled");
          } else if (now >= r.deadline) {
            r.abort = MakeFailure("NAT_ERR_XFER_TIMEOUT", "the read did not complete before its deadline");
            r.abort->peer = r.peer;
          }
          if (r.abort) r.abort_at = now;
        }
        if (PollRead(r, now, out)) {
          active_[i] = std::move(active_.back());
          active_.pop_back();
        } else {
          ++i;
        }
      }
      if (!stop) DrainNotifications(out);
    }
    cancels.clear();
    Emit(out);
    if (stop) {
      // Leave once every read has settled for JS. Tainted and orphaned requests stay in
      // active_ for Shutdown: destroying the agent tears down UCX, which stops them.
      std::lock_guard<std::mutex> lock(nixl_mu_);
      const bool settled = std::all_of(active_.begin(), active_.end(),
                                       [](const auto& r) { return r->tainted || r->orphaned; });
      if (settled) break;
    }
  }
}

void NativeAgent::Emit(std::vector<Event*>& out) {
  for (Event* e : out) {
    // Fails only while the function is closing; the event then has no one to go to.
    if (tsfn_.NonBlockingCall(e) != napi_ok) delete e;
  }
  out.clear();
}

bool NativeAgent::StartRead(PendingRead& r, std::vector<Event*>& out) {
  const SymbolTable& api = *Nixl();
  if (agent_ == nullptr) {
    Settle(r, AgentClosed(), out);
    return false;
  }
  Status st = kSuccess;
  if (r.notif) {
    st = api.create_opt_args(&r.opt);
    // has_notif first: set_notif_msg only copies the message into `notif` once it is set.
    if (st == kSuccess) st = api.opt_args_set_has_notif(r.opt, true);
    if (st == kSuccess) st = api.opt_args_set_notif_msg(r.opt, r.notif->data(), r.notif->size());
    if (st != kSuccess) {
      Settle(r, StatusFailure("opt_args_set_notif_msg", st), out);
      return false;
    }
  }
  if (r.prepared) {
    auto l = lists_.find(r.local_list_id);
    auto m = lists_.find(r.remote_list_id);
    if (l == lists_.end() || m == lists_.end()) {
      Settle(r, MakeFailure("NAT_ERR_INVALID_ARG", "prepared descriptor list was released"), out);
      return false;
    }
    st = api.make_xfer_req(agent_, kXferRead, l->second, r.local_idx.data(), r.local_idx.size(), m->second,
                           r.remote_idx.data(), r.remote_idx.size(), &r.req, r.opt);
    if (st != kSuccess) {
      r.req = nullptr;
      Settle(r, ClassifyXferError("make_xfer_req", st, r.peer), out);
      return false;
    }
  } else {
    st = api.create_xfer_dlist(r.local_kind, &r.local_list);
    if (st == kSuccess) st = api.create_xfer_dlist(r.remote_kind, &r.remote_list);
    if (st != kSuccess) {
      Settle(r, StatusFailure("create_xfer_dlist", st), out);
      return false;
    }
    for (size_t i = 0; i + 2 < r.local.size() && st == kSuccess; i += 3) {
      st = api.xfer_dlist_add_desc(r.local_list, static_cast<uintptr_t>(r.local[i]), r.local[i + 1], r.local[i + 2]);
      if (st == kSuccess) {
        st = api.xfer_dlist_add_desc(r.remote_list, static_cast<uintptr_t>(r.remote[i]), r.remote[i + 1], r.remote[i + 2]);
      }
    }
    if (st != kSuccess) {
      Settle(r, StatusFailure("xfer_dlist_add_desc", st), out);
      return false;
    }
    st = api.create_xfer_req(agent_, kXferRead, r.local_list, r.remote_list, r.peer.c_str(), &r.req, r.opt);
    if (st != kSuccess) {
      r.req = nullptr;
      Settle(r, ClassifyXferError("create_xfer_req", st, r.peer), out);
      return false;
    }
  }
  r.posted_at = Clock::now();
  st = api.post_xfer_req(agent_, r.req, nullptr);
  if (st == kSuccess) {
    Settle(r, std::nullopt, out);
    return false;
  }
  if (st != kInProg) {
    // A failed post leaves nothing in flight (NIXL reports the request done with an error).
    Settle(r, ClassifyXferError("post_xfer_req", st, r.peer), out);
    return false;
  }
  return true;
}

// Polls one posted request. A request is released only once NIXL reports it done: releasing
// an active UCX request cancels it with ucp_request_cancel, which UCX does not honour for
// RMA gets, so bytes would keep landing after the read settled (issue #7, item 1).
bool NativeAgent::PollRead(PendingRead& r, Clock::time_point now, std::vector<Event*>& out) {
  if (r.orphaned) return false;
  const Status st = Nixl()->get_xfer_status(agent_, r.req);
  if (st == kInProg) {
    if (r.abort && !r.tainted && now - r.abort_at >= quiesce_) {
      // NIXL cannot confirm the request stopped: tell JS now that its destination is tainted,
      // keep polling, and send kQuiesced once it is done.
      Failure f = MakeFailure("NAT_ERR_XFER_TAINTED",
                              "read aborted (" + r.abort->code + ": " + r.abort->message + ") but NIXL still reports it in progress after " +
                                  std::to_string(quiesce_.count()) + " ms; its destination stays pinned until it is done");
      f.peer = r.peer;
      tainted_total_++;
      Settle(r, f, out);
      r.tainted = true;
    }
    return false;
  }
  if (r.tainted) {
    ReleaseHandles(r);
    auto* e = new Event();
    e->kind = Event::kQuiesced;
    e->id = r.id;
    out.push_back(e);
    return true;
  }
  if (r.abort) {
    // Done (finished or failed) after an abort: quiescent, so the abort can be reported.
    Settle(r, r.abort, out);
  } else if (st == kSuccess) {
    Settle(r, std::nullopt, out);
  } else {
    Settle(r, ClassifyXferError("get_xfer_status", st, r.peer), out);
  }
  return true;
}

// The C API folds REMOTE_DISCONNECT into ERROR_BACKEND, so the status alone cannot say "peer
// gone". Two checks recover it (docs/native.md, "Disconnects"):
// 1. check_remote_md. NIXL up to v1.4 forgets a peer that disconnected, so a failure on a
//    peer this agent loaded means "peer gone"; on a peer never loaded (or invalidated here)
//    it means "unknown peer".
// 2. From v1.5 NIXL keeps the metadata of a disconnected peer (check_remote_md succeeds) and
//    every later post fails. For post/status failures, and only toward peers that advertised
//    it (our own agents), the addon sends a probe notification: UCX fails it at once on an
//    endpoint in error state, while a live peer receives it and its addon drops it. Toward
//    any other peer the ambiguous error stays a failed READ (NAT_ERR_NIXL_BACKEND), and only
//    the control plane invalidates it (issue #7, item 7).
Failure NativeAgent::ClassifyXferError(const char* op, Status status, const std::string& peer) {
  Failure f = StatusFailure(op, status, peer);
  if (status != kErrBackend && status != kErrNotFound) return f;
  const SymbolTable& api = *Nixl();
  const bool loaded = peers_.count(peer) > 0;
  const Status check = api.check_remote_md(agent_, peer.c_str(), nullptr);
  if (check != kSuccess) {
    if (loaded) {
      f.code = "NAT_ERR_REMOTE_DISCONNECT";
      f.message = "peer " + peer + " disconnected (" + f.message + ", check_remote_md returned " +
                  std::to_string(static_cast<int>(check)) + ")";
    } else {
      f.code = "NAT_ERR_PEER_UNKNOWN";
      f.message = "no metadata loaded for peer " + peer + " (" + f.message + ")";
    }
    return f;
  }
  if (std::strcmp(op, "create_xfer_req") == 0 || std::strcmp(op, "make_xfer_req") == 0) return f;
  if (probe_peers_.count(peer) == 0) return f;
  probes_sent_++;
  const Status probe = api.gen_notif(agent_, peer.c_str(), kProbeNotif, kProbeNotifLen, nullptr);
  if (probe != kSuccess) {
    f.code = "NAT_ERR_REMOTE_DISCONNECT";
    f.message = "peer " + peer + " disconnected (" + f.message + ", probe notification returned " +
                std::to_string(static_cast<int>(probe)) + ")";
  }
  return f;
}

void NativeAgent::Settle(PendingRead& r, std::optional<Failure> failure, std::vector<Event*>& out) {
  const double micros =
      std::chrono::duration<double, std::micro>(Clock::now() - r.posted_at).count();
  // A tainted read keeps its request: it is released once NIXL reports it done.
  const bool tainting = failure && failure->code == "NAT_ERR_XFER_TAINTED";
  if (!tainting) ReleaseHandles(r);
  auto* e = new Event();
  e->kind = Event::kReadSettled;
  e->deferred = std::move(r.deferred);
  e->failure = std::move(failure);
  e->bytes = static_cast<double>(r.bytes);
  e->micros = micros;
  out.push_back(e);
}

void NativeAgent::ReleaseHandles(PendingRead& r) {
  const SymbolTable& api = *Nixl();
  if (r.req != nullptr && agent_ != nullptr) {
    // Only reached once NIXL reported the request done (or never posted), so release does not
    // have to abort anything. If NIXL refuses, the C handle is leaked rather than destroyed
    // under NIXL's feet; destroying the agent frees NIXL's side.
    if (api.release_xfer_req(agent_, r.req) == kSuccess) api.destroy_xfer_req(r.req);
  }
  r.req = nullptr;
  if (r.local_list != nullptr) api.destroy_xfer_dlist(r.local_list);
  if (r.remote_list != nullptr) api.destroy_xfer_dlist(r.remote_list);
  if (r.opt != nullptr) api.destroy_opt_args(r.opt);
  r.local_list = r.remote_list = nullptr;
  r.opt = nullptr;
}

void NativeAgent::DrainNotifications(std::vector<Event*>& out) {
  const SymbolTable& api = *Nixl();
  // Without a backend NIXL logs an error on every get_notifs call; nothing can arrive yet.
  if (agent_ == nullptr || notif_map_ == nullptr || backends_.empty()) return;
  if (api.get_notifs(agent_, notif_map_, nullptr) != kSuccess) {
    // get_notifs appends to the map; a failure may leave it half filled. Clear it so the next
    // drain neither delivers those twice nor mixes them up; count the failure (stats()).
    notif_errors_++;
    api.notif_map_clear(notif_map_);
    return;
  }
  size_t agents = 0;
  if (api.notif_map_size(notif_map_, &agents) != kSuccess || agents == 0) {
    api.notif_map_clear(notif_map_);
    return;
  }
  for (size_t i = 0; i < agents; ++i) {
    const char* name = nullptr;
    if (api.notif_map_get_agent_at(notif_map_, i, &name) != kSuccess || name == nullptr) {
      notif_errors_++;
      continue;
    }
    size_t count = 0;
    if (api.notif_map_get_notifs_size(notif_map_, name, &count) != kSuccess) {
      notif_errors_++;
      continue;
    }
    for (size_t j = 0; j < count; ++j) {
      const void* data = nullptr;
      size_t len = 0;
      if (api.notif_map_get_notif(notif_map_, name, j, &data, &len) != kSuccess) {
        notif_errors_++;
        continue;
      }
      if (len == kProbeNotifLen && std::memcmp(data, kProbeNotif, kProbeNotifLen) == 0) continue;
      auto* e = new Event();
      e->kind = Event::kNotification;
      e->peer = name;
      e->message.assign(static_cast<const char*>(data), len);
      out.push_back(e);
    }
  }
  api.notif_map_clear(notif_map_);
}

}  // namespace hnx
