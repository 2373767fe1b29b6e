#include "agent.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "nixl_loader.h"

namespace hnx {
namespace {

Napi::Promise Rejected(Napi::Env env, const Failure& f) {
  auto d = Napi::Promise::Deferred::New(env);
  d.Reject(ToJsError(env, f).Value());
  return d.Promise();
}

std::string StringArg(const Napi::CallbackInfo& info, size_t i, const char* what) {
  if (info.Length() <= i || !info[i].IsString()) throw ArgError(info.Env(), std::string(what) + " must be a string");
  return info[i].As<Napi::String>().Utf8Value();
}

// Copies a BigUint64Array of (addr, len, devId) triples; the JS array may change afterwards.
std::vector<uint64_t> TriplesArg(const Napi::CallbackInfo& info, size_t i, const char* what) {
  if (info.Length() <= i || !info[i].IsTypedArray() ||
      info[i].As<Napi::TypedArray>().TypedArrayType() != napi_biguint64_array) {
    throw ArgError(info.Env(), std::string(what) + " must be a BigUint64Array");
  }
  auto arr = info[i].As<Napi::TypedArrayOf<uint64_t>>();
  if (arr.ElementLength() == 0 || arr.ElementLength() % 3 != 0) {
    throw ArgError(info.Env(), std::string(what) + " must hold (addr, len, devId) triples");
  }
  return std::vector<uint64_t>(arr.Data(), arr.Data() + arr.ElementLength());
}

MemType KindArg(const Napi::CallbackInfo& info, size_t i) {
  if (info.Length() <= i || !info[i].IsNumber()) throw ArgError(info.Env(), "memory kind must be a number");
  int k = info[i].As<Napi::Number>().Int32Value();
  if (k != kMemDram && k != kMemVram) throw ArgError(info.Env(), "memory kind must be DRAM (0) or VRAM (1)");
  return static_cast<MemType>(k);
}

std::optional<std::string> OptionalBytes(const Napi::CallbackInfo& info, size_t i) {
  if (info.Length() <= i || info[i].IsUndefined() || info[i].IsNull()) return std::nullopt;
  if (!info[i].IsBuffer()) throw ArgError(info.Env(), "notification must be a Buffer");
  auto b = info[i].As<Napi::Buffer<char>>();
  return std::string(b.Data(), b.Length());
}

std::vector<std::string> ReadStringList(const SymbolTable& api, StringList list) {
  std::vector<std::string> out;
  size_t n = 0;
  if (api.string_list_size(list, &n) != kSuccess) return out;
  for (size_t i = 0; i < n; ++i) {
    const char* s = nullptr;
    if (api.string_list_get(list, i, &s) == kSuccess && s != nullptr) out.emplace_back(s);
  }
  return out;
}

using ParamPairs = std::vector<std::pair<std::string, std::string>>;

ParamPairs ReadParams(const SymbolTable& api, Params params) {
  ParamPairs out;
  bool empty = true;
  if (api.params_is_empty(params, &empty) != kSuccess || empty) return out;
  ParamIter it = nullptr;
  if (api.params_create_iterator(params, &it) != kSuccess) return out;
  // The iterator reports has_next == false together with the last pair, and bounds the loop
  // to the map's size; the cap is belt and braces against a misbehaving library.
  for (int guard = 0; guard < 4096; ++guard) {
    const char* k = nullptr;
    const char* v = nullptr;
    bool more = false;
    if (api.params_iterator_next(it, &k, &v, &more) != kSuccess) break;
    if (k != nullptr) out.emplace_back(k, v != nullptr ? v : "");
    if (!more) break;
  }
  api.params_destroy_iterator(it);
  return out;
}

std::vector<std::string> ReadMemList(const SymbolTable& api, MemList mems) {
  static const char* const kNames[] = {"dram", "vram", "block", "object", "file", "unknown"};
  std::vector<std::string> out;
  size_t n = 0;
  if (api.mem_list_size(mems, &n) != kSuccess) return out;
  for (size_t i = 0; i < n; ++i) {
    MemType t = kMemUnknown;
    if (api.mem_list_get(mems, i, &t) == kSuccess && t >= 0 && t <= kMemUnknown) out.emplace_back(kNames[t]);
  }
  return out;
}

Napi::Object ParamsObject(Napi::Env env, const ParamPairs& pairs) {
  Napi::Object o = Napi::Object::New(env);
  for (const auto& [k, v] : pairs) o.Set(k, v);
  return o;
}

Napi::Array StringArray(Napi::Env env, const std::vector<std::string>& items) {
  Napi::Array a = Napi::Array::New(env, items.size());
  for (size_t i = 0; i < items.size(); ++i) a.Set(static_cast<uint32_t>(i), items[i]);
  return a;
}

}  // namespace

Failure AgentClosed() { return MakeFailure("NAT_ERR_AGENT_CLOSED", "the NIXL agent is closed"); }

// The JS callback is onEvent(kind, a, b): ('notification', peer, Buffer) or ('quiesced', id).
void DispatchEvent(Napi::Env env, Napi::Function on_event, Bridge* bridge, Event* raw) {
  std::unique_ptr<Event> event(raw);
  // env is null while the function is being torn down: only free the data.
  if (env == nullptr || event == nullptr) return;
  if (event->kind == Event::kReadSettled) {
    if (event->failure) {
      event->deferred->Reject(ToJsError(env, *event->failure).Value());
    } else {
      Napi::Object result = Napi::Object::New(env);
      result.Set("bytes", event->bytes);
      result.Set("micros", event->micros);
      event->deferred->Resolve(result);
    }
    if (bridge != nullptr && bridge->owner != nullptr) bridge->owner->ReadSettled(env);
    return;
  }
  if (on_event.IsEmpty() || !on_event.IsFunction()) return;
  if (event->kind == Event::kQuiesced) {
    on_event.Call({Napi::String::New(env, "quiesced"), Napi::Number::New(env, event->id)});
    return;
  }
  on_event.Call({Napi::String::New(env, "notification"), Napi::String::New(env, event->peer),
                 Napi::Buffer<char>::Copy(env, event->message.data(), event->message.size())});
}

void FinalizeBridge(Napi::Env, void*, Bridge* bridge) {
  if (bridge->owner != nullptr) bridge->owner->bridge_ = nullptr;
  delete bridge;
}

Napi::Function NativeAgent::Init(Napi::Env env) {
  return DefineClass(env, "NativeAgent",
                     {
                         InstanceMethod<&NativeAgent::Create>("create"),
                         InstanceMethod<&NativeAgent::ListPlugins>("listPlugins"),
                         InstanceMethod<&NativeAgent::PluginParams>("pluginParams"),
                         InstanceMethod<&NativeAgent::CreateBackend>("createBackend"),
                         InstanceMethod<&NativeAgent::RegisterMem>("registerMem"),
                         InstanceMethod<&NativeAgent::DeregisterMem>("deregisterMem"),
                         InstanceMethod<&NativeAgent::LocalMetadata>("localMetadata"),
                         InstanceMethod<&NativeAgent::LoadRemoteMetadata>("loadRemoteMetadata"),
                         InstanceMethod<&NativeAgent::InvalidatePeer>("invalidatePeer"),
                         InstanceMethod<&NativeAgent::CheckPeer>("checkPeer"),
                         InstanceMethod<&NativeAgent::GenNotif>("genNotif"),
                         InstanceMethod<&NativeAgent::PrepList>("prepList"),
                         InstanceMethod<&NativeAgent::ReleaseList>("releaseList"),
                         InstanceMethod<&NativeAgent::Read>("read"),
                         InstanceMethod<&NativeAgent::ReadPrepared>("readPrepared"),
                         InstanceMethod<&NativeAgent::Cancel>("cancel"),
                         InstanceMethod<&NativeAgent::Stats>("stats"),
                         InstanceMethod<&NativeAgent::Close>("close"),
                     });
}

// new NativeAgent(onEvent(kind, a, b)). The gate passes a function that holds its agent only
// weakly: the function is a GC root while the thread-safe function lives, and a strong
// reference back would keep a dropped agent alive forever (issue #7, item 3).
NativeAgent::NativeAgent(const Napi::CallbackInfo& info) : Napi::ObjectWrap<NativeAgent>(info) {
  Napi::Env env = info.Env();
  if (info.Length() < 1 || !info[0].IsFunction()) throw ArgError(env, "onEvent must be a function");
  bridge_ = new Bridge{this};
  tsfn_ = EventTsfn::New(env, info[0].As<Napi::Function>(), "handoff-nixl-events", 0, 1, bridge_,
                         FinalizeBridge, static_cast<void*>(nullptr));
  // Unreferenced until a read is pending: an idle agent must not keep the process alive.
  tsfn_.Unref(env);
}

NativeAgent::~NativeAgent() {
  // Reached only when JS dropped the object without close(): no read is pending (each pending
  // read holds a strong reference) and no one-shot worker is running (each holds one too).
  closed_ = true;
  Shutdown();
  if (bridge_ != nullptr) bridge_->owner = nullptr;
  // At process exit Node closes every thread-safe function itself, in an order of its own, and
  // runs the remaining ObjectWrap finalizers from inside that: releasing then touched a
  // function already torn down and aborted the process (seen with three live agents at exit).
  if (!tsfn_released_ && !ProcessExiting()) {
    tsfn_.Release();
    tsfn_released_ = true;
  }
}

std::optional<Failure> NativeAgent::Unusable() const {
  if (closed_) return AgentClosed();
  if (Nixl() == nullptr) return MakeFailure("NAT_ERR_NIXL_NOT_AVAILABLE", "NIXL is not loaded");
  return std::nullopt;
}

Napi::Promise NativeAgent::RunLocked(Napi::Env env, const char* name, LockedFn body, OneShot::ResolveFn resolve) {
  if (auto bad = Unusable()) return Rejected(env, *bad);
  return OneShot::Run(env, Value(), name,
      [this, body = std::move(body)]() -> std::optional<Failure> {
        const SymbolTable& api = *Nixl();
        std::lock_guard<std::mutex> lock(nixl_mu_);
        if (agent_ == nullptr) return AgentClosed();
        return body(api);
      },
      std::move(resolve));
}

// create(name, progThread, syncMode, pthrDelayUs, busyPollUs, idlePollUs, quiesceMs) -> Promise<void>
Napi::Value NativeAgent::Create(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (auto bad = Unusable()) return Rejected(env, *bad);
  std::string name = StringArg(info, 0, "agent name");
  AgentConfig cfg{};
  cfg.enable_prog_thread = info.Length() > 1 && info[1].ToBoolean().Value();
  cfg.enable_listen_thread = false;  // metadata travels over the application's own channel
  cfg.listen_port = 0;
  cfg.thread_sync = static_cast<ThreadSync>(info.Length() > 2 ? info[2].ToNumber().Int32Value() : 0);
  cfg.num_workers = 1;
  cfg.pthr_delay_us = info.Length() > 3 ? static_cast<uint64_t>(info[3].ToNumber().Int64Value()) : 0;
  cfg.lthr_delay_us = 100000;
  cfg.capture_telemetry = false;
  if (info.Length() > 4) busy_poll_ = std::chrono::microseconds(info[4].ToNumber().Int64Value());
  if (info.Length() > 5) idle_poll_ = std::chrono::microseconds(info[5].ToNumber().Int64Value());
  if (info.Length() > 6) quiesce_ = std::chrono::milliseconds(info[6].ToNumber().Int64Value());

  return OneShot::Run(env, Value(), "nixl.createAgent",
      [this, name, cfg]() -> std::optional<Failure> {
        const SymbolTable& api = *Nixl();
        std::lock_guard<std::mutex> lock(nixl_mu_);
        if (closed_) return AgentClosed();
        if (agent_ != nullptr) return MakeFailure("NAT_ERR_INVALID_ARG", "agent already created");
        Agent a = nullptr;
        Status st = api.create_configured_agent(name.c_str(), &cfg, &a);
        if (st != kSuccess) return StatusFailure("create_configured_agent", st);
        NotifMap map = nullptr;
        st = api.create_notif_map(&map);
        if (st != kSuccess) {
          api.destroy_agent(a);
          return StatusFailure("create_notif_map", st);
        }
        agent_ = a;
        notif_map_ = map;
        name_ = name;
        poller_ = std::thread(&NativeAgent::PollLoop, this);
        return std::nullopt;
      },
      nullptr);
}

Napi::Value NativeAgent::ListPlugins(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  auto names = std::make_shared<std::vector<std::string>>();
  return RunLocked(env, "nixl.listPlugins",
      [this, names](const SymbolTable& api) -> std::optional<Failure> {
        StringList list = nullptr;
        Status st = api.get_available_plugins(agent_, &list);
        if (st != kSuccess) return StatusFailure("get_available_plugins", st);
        *names = ReadStringList(api, list);
        api.destroy_string_list(list);
        return std::nullopt;
      },
      [names](Napi::Env e) -> Napi::Value { return StringArray(e, *names); });
}

Napi::Value NativeAgent::PluginParams(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string plugin = StringArg(info, 0, "plugin name");
  auto pairs = std::make_shared<ParamPairs>();
  auto mems = std::make_shared<std::vector<std::string>>();
  return RunLocked(env, "nixl.pluginParams",
      [this, plugin, pairs, mems](const SymbolTable& api) -> std::optional<Failure> {
        MemList ml = nullptr;
        Params p = nullptr;
        Status st = api.get_plugin_params(agent_, plugin.c_str(), &ml, &p);
        if (st != kSuccess) {
          Failure f = StatusFailure("get_plugin_params", st);
          f.code = "NAT_ERR_PLUGIN_MISSING";
          f.message = "NIXL plugin " + plugin + " is not available (" + f.message + ")";
          return f;
        }
        *pairs = ReadParams(api, p);
        *mems = ReadMemList(api, ml);
        api.destroy_params(p);
        api.destroy_mem_list(ml);
        return std::nullopt;
      },
      [pairs, mems](Napi::Env e) -> Napi::Value {
        Napi::Object o = Napi::Object::New(e);
        o.Set("mems", StringArray(e, *mems));
        o.Set("params", ParamsObject(e, *pairs));
        return o;
      });
}

// createBackend(plugin, params: Record<string, string>) -> Promise<{mems, params}>
Napi::Value NativeAgent::CreateBackend(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string plugin = StringArg(info, 0, "plugin name");
  ParamPairs input;
  if (info.Length() > 1 && info[1].IsObject()) {
    Napi::Object o = info[1].As<Napi::Object>();
    Napi::Array keys = o.GetPropertyNames();
    for (uint32_t i = 0; i < keys.Length(); ++i) {
      Napi::Value k = keys.Get(i);
      Napi::Value v = o.Get(k);
      if (!v.IsString()) throw ArgError(env, "backend parameter values must be strings");
      input.emplace_back(k.ToString().Utf8Value(), v.As<Napi::String>().Utf8Value());
    }
  }
  auto effective = std::make_shared<ParamPairs>();
  auto mems = std::make_shared<std::vector<std::string>>();
  return RunLocked(env, "nixl.createBackend",
      [this, plugin, input, effective, mems](const SymbolTable& api) -> std::optional<Failure> {
        Params p = nullptr;
        Status st = api.create_params(&p);
        if (st != kSuccess) return StatusFailure("create_params", st);
        for (const auto& [k, v] : input) {
          st = api.params_add(p, k.c_str(), v.c_str());
          if (st != kSuccess) {
            api.destroy_params(p);
            Failure f = StatusFailure("params_add", st);
            f.code = "NAT_ERR_BACKEND_CREATE";
            f.message = "backend parameter " + k + " was refused (" + f.message + ")";
            return f;
          }
        }
        Backend b = nullptr;
        st = api.create_backend(agent_, plugin.c_str(), p, &b);
        api.destroy_params(p);
        if (st != kSuccess) {
          Failure f = StatusFailure("create_backend", st);
          f.code = "NAT_ERR_BACKEND_CREATE";
          f.message = "creating the " + plugin + " backend failed (" + f.message + ")";
          return f;
        }
        backends_.push_back(b);
        // The backend exists now (NIXL owns it); failing to read its parameters is reported
        // rather than answered with an empty set that looks like "no parameters".
        MemList ml = nullptr;
        Params bp = nullptr;
        st = api.get_backend_params(agent_, b, &ml, &bp);
        if (st != kSuccess) return StatusFailure("get_backend_params", st);
        *effective = ReadParams(api, bp);
        *mems = ReadMemList(api, ml);
        api.destroy_params(bp);
        api.destroy_mem_list(ml);
        return std::nullopt;
      },
      [effective, mems](Napi::Env e) -> Napi::Value {
        Napi::Object o = Napi::Object::New(e);
        o.Set("mems", StringArray(e, *mems));
        o.Set("params", ParamsObject(e, *effective));
        return o;
      });
}

Napi::Value NativeAgent::RegisterMem(const Napi::CallbackInfo& info) { return MemoryCall(info, true); }
Napi::Value NativeAgent::DeregisterMem(const Napi::CallbackInfo& info) { return MemoryCall(info, false); }

// (de)registerMem(kind, triples: BigUint64Array) -> Promise<void>. The TS gate keeps the
// JS memory referenced while it is registered.
Napi::Value NativeAgent::MemoryCall(const Napi::CallbackInfo& info, bool do_register) {
  Napi::Env env = info.Env();
  MemType kind = KindArg(info, 0);
  std::vector<uint64_t> triples = TriplesArg(info, 1, "descriptors");
  return RunLocked(env, do_register ? "nixl.registerMem" : "nixl.deregisterMem",
      [this, kind, triples, do_register](const SymbolTable& api) -> std::optional<Failure> {
        RegDlist list = nullptr;
        Status st = api.create_reg_dlist(kind, &list);
        if (st != kSuccess) return StatusFailure("create_reg_dlist", st);
        for (size_t i = 0; i + 2 < triples.size(); i += 3) {
          st = api.reg_dlist_add_desc(list, static_cast<uintptr_t>(triples[i]), triples[i + 1], triples[i + 2], nullptr, 0);
          if (st != kSuccess) {
            api.destroy_reg_dlist(list);
            return StatusFailure("reg_dlist_add_desc", st);
          }
        }
        st = do_register ? api.register_mem(agent_, list, nullptr) : api.deregister_mem(agent_, list, nullptr);
        api.destroy_reg_dlist(list);
        if (st != kSuccess) {
          Failure f = StatusFailure(do_register ? "register_mem" : "deregister_mem", st);
          f.code = do_register ? "NAT_ERR_REGISTER" : "NAT_ERR_DEREGISTER";
          return f;
        }
        return std::nullopt;
      },
      nullptr);
}

Napi::Value NativeAgent::LocalMetadata(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  auto blob = std::make_shared<std::string>();
  return RunLocked(env, "nixl.localMetadata",
      [this, blob](const SymbolTable& api) -> std::optional<Failure> {
        void* data = nullptr;
        size_t len = 0;
        Status st = api.get_local_md(agent_, &data, &len);
        if (st != kSuccess) return StatusFailure("get_local_md", st);
        blob->assign(static_cast<const char*>(data), len);
        std::free(data);  // malloc'd by NIXL's C layer; the caller frees it
        return std::nullopt;
      },
      [blob](Napi::Env e) -> Napi::Value { return Napi::Buffer<char>::Copy(e, blob->data(), blob->size()); });
}

Napi::Value NativeAgent::LoadRemoteMetadata(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 1 || !info[0].IsBuffer()) throw ArgError(env, "metadata must be a Buffer");
  auto b = info[0].As<Napi::Buffer<char>>();
  if (b.Length() == 0) throw ArgError(env, "metadata must not be empty");
  std::string blob(b.Data(), b.Length());
  // Whether the peer advertised the disconnect probe in its handshake (our own agents do).
  const bool probe = info.Length() > 1 && info[1].ToBoolean().Value();
  auto peer = std::make_shared<std::string>();
  return RunLocked(env, "nixl.loadRemoteMetadata",
      [this, blob, peer, probe](const SymbolTable& api) -> std::optional<Failure> {
        char* name = nullptr;
        Status st = api.load_remote_md(agent_, blob.data(), blob.size(), &name);
        if (st != kSuccess) {
          Failure f = StatusFailure("load_remote_md", st);
          f.code = "NAT_ERR_METADATA_REJECTED";
          return f;
        }
        peer->assign(name);
        std::free(name);  // strdup'd by NIXL's C layer
        peers_.insert(*peer);
        if (probe) {
          probe_peers_.insert(*peer);
        } else {
          probe_peers_.erase(*peer);
        }
        return std::nullopt;
      },
      [peer](Napi::Env e) -> Napi::Value { return Napi::String::New(e, *peer); });
}

Napi::Value NativeAgent::InvalidatePeer(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string peer = StringArg(info, 0, "peer name");
  return RunLocked(env, "nixl.invalidatePeer",
      [this, peer](const SymbolTable& api) -> std::optional<Failure> {
        // After invalidation NIXL answers get_xfer_status with NOT_FOUND without asking UCX,
        // so a request still in flight could never be confirmed done. Refuse while any is;
        // tainted ones (already reported to JS) become orphans, kept until the agent dies.
        for (const auto& r : active_) {
          if (r->peer == peer && !r->tainted && !r->orphaned) {
            Failure f = MakeFailure("NAT_ERR_PEER_BUSY", "reads to " + peer + " are still in flight");
            f.peer = peer;
            return f;
          }
        }
        const bool known = peers_.count(peer) > 0;
        Status st = api.invalidate_remote_md(agent_, peer.c_str());
        if (st != kSuccess) {
          Failure f = StatusFailure("invalidate_remote_md", st, peer);
          // NIXL forgets a peer by itself after a disconnect; report that as "unknown peer".
          if (!known) f.code = "NAT_ERR_PEER_UNKNOWN";
          return f;
        }
        // Forgotten only once NIXL confirmed (issue #7, item 5).
        peers_.erase(peer);
        probe_peers_.erase(peer);
        for (auto& r : active_) {
          if (r->peer == peer && r->tainted) r->orphaned = true;
        }
        return std::nullopt;
      },
      nullptr);
}

Napi::Value NativeAgent::CheckPeer(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string peer = StringArg(info, 0, "peer name");
  auto present = std::make_shared<bool>(false);
  return RunLocked(env, "nixl.checkPeer",
      [this, peer, present](const SymbolTable& api) -> std::optional<Failure> {
        // SUCCESS: present. NOT_FOUND (1.5+), or BACKEND for a peer this agent does not hold
        // (NIXL <= 1.4 has no NOT_FOUND): absent. Anything else is an error, not "absent".
        const Status st = api.check_remote_md(agent_, peer.c_str(), nullptr);
        if (st == kSuccess) {
          *present = true;
        } else if (st == kErrNotFound || (st == kErrBackend && peers_.count(peer) == 0)) {
          *present = false;
        } else {
          return StatusFailure("check_remote_md", st, peer);
        }
        return std::nullopt;
      },
      [present](Napi::Env e) -> Napi::Value { return Napi::Boolean::New(e, *present); });
}

Napi::Value NativeAgent::GenNotif(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string peer = StringArg(info, 0, "peer name");
  std::optional<std::string> msg = OptionalBytes(info, 1);
  if (!msg) throw ArgError(env, "notification must be a Buffer");
  std::string body = *msg;
  return RunLocked(env, "nixl.genNotif",
      [this, peer, body](const SymbolTable& api) -> std::optional<Failure> {
        Status st = api.gen_notif(agent_, peer.c_str(), body.data(), body.size(), nullptr);
        if (st != kSuccess) {
          Failure f = StatusFailure("gen_notif", st, peer);
          if (peers_.count(peer) == 0) f.code = "NAT_ERR_PEER_UNKNOWN";
          return f;
        }
        return std::nullopt;
      },
      nullptr);
}

// prepList(peer ('' for local), kind, triples) -> Promise<number>: a descriptor list prepared
// once (prep_xfer_dlist), then named by index in readPrepared. Preparing the KV region once
// per peer saves NIXL the per-request descriptor lookups of create_xfer_req.
Napi::Value NativeAgent::PrepList(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 1 || !info[0].IsString()) throw ArgError(env, "peer name must be a string ('' for local)");
  std::string peer = info[0].As<Napi::String>().Utf8Value();
  MemType kind = KindArg(info, 1);
  std::vector<uint64_t> triples = TriplesArg(info, 2, "descriptors");
  auto id = std::make_shared<uint32_t>(0);
  return RunLocked(env, "nixl.prepList",
      [this, peer, kind, triples, id](const SymbolTable& api) -> std::optional<Failure> {
        XferDlist list = nullptr;
        Status st = api.create_xfer_dlist(kind, &list);
        if (st != kSuccess) return StatusFailure("create_xfer_dlist", st);
        for (size_t i = 0; i + 2 < triples.size() && st == kSuccess; i += 3) {
          st = api.xfer_dlist_add_desc(list, static_cast<uintptr_t>(triples[i]), triples[i + 1], triples[i + 2]);
        }
        if (st != kSuccess) {
          api.destroy_xfer_dlist(list);
          return StatusFailure("xfer_dlist_add_desc", st);
        }
        XferDlistHandle handle = nullptr;
        st = api.prep_xfer_dlist(agent_, peer.c_str(), list, &handle, nullptr);
        api.destroy_xfer_dlist(list);
        if (st != kSuccess) {
          Failure f = StatusFailure("prep_xfer_dlist", st, peer);
          if (!peer.empty() && peers_.count(peer) == 0) f.code = "NAT_ERR_PEER_UNKNOWN";
          return f;
        }
        *id = next_list_id_++;
        lists_[*id] = handle;
        return std::nullopt;
      },
      [id](Napi::Env e) -> Napi::Value { return Napi::Number::New(e, *id); });
}

Napi::Value NativeAgent::ReleaseList(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 1 || !info[0].IsNumber()) throw ArgError(env, "list id must be a number");
  const uint32_t id = info[0].As<Napi::Number>().Uint32Value();
  return RunLocked(env, "nixl.releaseList",
      [this, id](const SymbolTable& api) -> std::optional<Failure> {
        auto it = lists_.find(id);
        if (it == lists_.end()) return MakeFailure("NAT_ERR_INVALID_ARG", "no prepared list " + std::to_string(id));
        for (const auto& r : active_) {
          if (r->prepared && (r->local_list_id == id || r->remote_list_id == id)) {
            return MakeFailure("NAT_ERR_MEMORY_IN_USE", "prepared list " + std::to_string(id) + " is used by a read in flight");
          }
        }
        Status st = api.release_xfer_dlist_handle(agent_, it->second);
        lists_.erase(it);  // the C handle is freed by the call whatever it returns
        if (st != kSuccess) return StatusFailure("release_xfer_dlist_handle", st);
        return std::nullopt;
      },
      nullptr);
}

Napi::Value NativeAgent::Submit(Napi::Env env, std::unique_ptr<PendingRead> r, double timeout_ms) {
  if (!(timeout_ms > 0)) throw ArgError(env, "timeoutMs must be positive");
  // Anything past ~31 years (Infinity included) means "no deadline": converting such a double
  // to an integer count is undefined behaviour and made Infinity fail at once (item 4).
  if (timeout_ms >= 1e12) {
    r->deadline = Clock::time_point::max();
  } else {
    r->deadline = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(timeout_ms * 1000));
  }
  r->deferred = std::make_unique<Napi::Promise::Deferred>(env);
  Napi::Promise promise = r->deferred->Promise();

  // While a read is pending the process must stay alive and this object must not be
  // collected: the poll thread and the event bridge both point at it.
  if (pending_reads_++ == 0) {
    tsfn_.Ref(env);
    Ref();
  }
  {
    std::lock_guard<std::mutex> lock(q_mu_);
    queue_.push_back(std::move(r));
  }
  q_cv_.notify_one();
  return promise;
}

// read(id, peer, localKind, local, remoteKind, remote, notif|null, timeoutMs) -> Promise
Napi::Value NativeAgent::Read(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (auto bad = Unusable()) return Rejected(env, *bad);
  auto r = std::make_unique<PendingRead>();
  if (info.Length() < 8 || !info[0].IsNumber() || !info[7].IsNumber()) throw ArgError(env, "read: bad arguments");
  r->id = info[0].As<Napi::Number>().Uint32Value();
  r->peer = StringArg(info, 1, "peer name");
  r->local_kind = KindArg(info, 2);
  r->local = TriplesArg(info, 3, "local descriptors");
  r->remote_kind = KindArg(info, 4);
  r->remote = TriplesArg(info, 5, "remote descriptors");
  r->notif = OptionalBytes(info, 6);
  if (r->local.size() != r->remote.size()) throw ArgError(env, "local and remote descriptor counts differ");
  for (size_t i = 0; i < r->local.size(); i += 3) {
    if (r->local[i + 1] != r->remote[i + 1]) throw ArgError(env, "descriptor lengths differ at index " + std::to_string(i / 3));
    r->bytes += r->local[i + 1];
  }
  return Submit(env, std::move(r), info[7].As<Napi::Number>().DoubleValue());
}

std::vector<int> IndicesArg(const Napi::CallbackInfo& info, size_t i, const char* what) {
  if (info.Length() <= i || !info[i].IsTypedArray() || info[i].As<Napi::TypedArray>().TypedArrayType() != napi_int32_array) {
    throw ArgError(info.Env(), std::string(what) + " must be an Int32Array");
  }
  auto arr = info[i].As<Napi::TypedArrayOf<int32_t>>();
  if (arr.ElementLength() == 0) throw ArgError(info.Env(), std::string(what) + " must not be empty");
  return std::vector<int>(arr.Data(), arr.Data() + arr.ElementLength());
}

// readPrepared(id, peer, localList, localIdx, remoteList, remoteIdx, notif|null, timeoutMs,
// bytes) -> Promise. The gate checks indices and lengths against what it prepared.
Napi::Value NativeAgent::ReadPrepared(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (auto bad = Unusable()) return Rejected(env, *bad);
  if (info.Length() < 9 || !info[0].IsNumber() || !info[2].IsNumber() || !info[4].IsNumber() || !info[7].IsNumber() ||
      !info[8].IsNumber()) {
    throw ArgError(env, "readPrepared: bad arguments");
  }
  auto r = std::make_unique<PendingRead>();
  r->prepared = true;
  r->id = info[0].As<Napi::Number>().Uint32Value();
  r->peer = StringArg(info, 1, "peer name");
  r->local_list_id = info[2].As<Napi::Number>().Uint32Value();
  r->local_idx = IndicesArg(info, 3, "local indices");
  r->remote_list_id = info[4].As<Napi::Number>().Uint32Value();
  r->remote_idx = IndicesArg(info, 5, "remote indices");
  if (r->local_idx.size() != r->remote_idx.size()) throw ArgError(env, "local and remote index counts differ");
  r->notif = OptionalBytes(info, 6);
  r->bytes = static_cast<uint64_t>(info[8].As<Napi::Number>().DoubleValue());
  return Submit(env, std::move(r), info[7].As<Napi::Number>().DoubleValue());
}

void NativeAgent::ReadSettled(Napi::Env env) {
  if (pending_reads_ > 0 && --pending_reads_ == 0) {
    if (!tsfn_released_) tsfn_.Unref(env);
    Unref();
  }
}

Napi::Value NativeAgent::Cancel(const Napi::CallbackInfo& info) {
  if (info.Length() < 1 || !info[0].IsNumber()) throw ArgError(info.Env(), "read id must be a number");
  {
    std::lock_guard<std::mutex> lock(q_mu_);
    cancels_.push_back(info[0].As<Napi::Number>().Uint32Value());
  }
  q_cv_.notify_one();
  return info.Env().Undefined();
}

// stats() -> counters for tests and metrics; atomics only, never blocks.
Napi::Value NativeAgent::Stats(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  Napi::Object o = Napi::Object::New(env);
  o.Set("probesSent", Napi::Number::New(env, static_cast<double>(probes_sent_.load())));
  o.Set("notifErrors", Napi::Number::New(env, static_cast<double>(notif_errors_.load())));
  o.Set("tainted", Napi::Number::New(env, static_cast<double>(tainted_total_.load())));
  return o;
}

Napi::Value NativeAgent::Close(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  closed_ = true;
  return OneShot::Run(env, Value(), "nixl.close",
      [this]() -> std::optional<Failure> {
        Shutdown();
        return std::nullopt;
      },
      [this](Napi::Env) -> Napi::Value {
        // Queued events (the rejections of reads cut short) still run after Release.
        if (!tsfn_released_) {
          tsfn_.Release();
          tsfn_released_ = true;
        }
        return Env().Undefined();
      });
}

void NativeAgent::Shutdown() {
  {
    // Taking the lock orders this after any create() that already started the poll thread;
    // closed_ stops any later one from starting it.
    std::lock_guard<std::mutex> lock(nixl_mu_);
  }
  {
    std::lock_guard<std::mutex> lock(q_mu_);
    stopping_ = true;
  }
  q_cv_.notify_one();
  // The poll thread aborts what is in flight and returns once every read has settled for JS:
  // done, or tainted after the quiesce period.
  if (poller_.joinable()) poller_.join();

  const SymbolTable* api = Nixl();
  std::lock_guard<std::mutex> lock(nixl_mu_);
  if (api == nullptr || agent_ == nullptr) return;
  // Tainted requests are released right before the agent goes: destroying it tears down the
  // UCX workers, after which nothing can write into their destinations any more.
  for (auto& r : active_) ReleaseHandles(*r);
  active_.clear();
  for (auto& [id, handle] : lists_) api->release_xfer_dlist_handle(agent_, handle);
  lists_.clear();
  // destroy_backend frees only the C handle; the agent owns and tears down the engines.
  for (Backend b : backends_) api->destroy_backend(b);
  backends_.clear();
  if (notif_map_ != nullptr) api->destroy_notif_map(notif_map_);
  notif_map_ = nullptr;
  api->destroy_agent(agent_);
  agent_ = nullptr;
  peers_.clear();
  probe_peers_.clear();
}

}  // namespace hnx
