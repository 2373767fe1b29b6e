// Module entry: the NIXL loader, the NativeAgent class and shared-memory helpers.
#include <napi.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "agent.h"
#include "common.h"
#include "nixl_loader.h"
#include "shm.h"

namespace hnx {
namespace {

// load(libDir) -> Promise<{ path, pluginDir }>. dlopen pulls in ~80 shared objects, so it runs
// on a worker thread.
Napi::Value Load(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 1 || !info[0].IsString()) throw ArgError(env, "library directory must be a string");
  std::string dir = info[0].As<Napi::String>().Utf8Value();
  // NIXL's plugin manager is a singleton that reads NIXL_PLUGIN_DIR once, at the first agent.
  // Set it here, on the JS thread (setenv is not safe against concurrent getenv), unless the
  // operator chose one.
  // A value this function set during an earlier, failed load is replaced. JS thread only.
  static bool plugin_dir_is_ours = false;
  const char* preset = std::getenv("NIXL_PLUGIN_DIR");
  std::string plugin_dir = dir + "/plugins";
  if (Nixl() == nullptr && (preset == nullptr || plugin_dir_is_ours)) {
    ::setenv("NIXL_PLUGIN_DIR", plugin_dir.c_str(), 1);
    plugin_dir_is_ours = true;
  } else if (preset != nullptr) {
    plugin_dir = preset;
  }
  auto outcome = std::make_shared<LoadOutcome>();
  return OneShot::Run(env, Napi::Object::New(env), "nixl.load",
      [dir, outcome]() -> std::optional<Failure> {
        *outcome = LoadNixl(dir);
        if (outcome->ok) return std::nullopt;
        return MakeFailure(outcome->code.c_str(), outcome->message + " [" + outcome->path + "]");
      },
      [outcome, plugin_dir](Napi::Env e) -> Napi::Value {
        Napi::Object o = Napi::Object::New(e);
        o.Set("path", outcome->path);
        o.Set("pluginDir", plugin_dir);
        return o;
      });
}

Napi::Value LoadedPathJs(const Napi::CallbackInfo& info) {
  if (Nixl() == nullptr) return info.Env().Null();
  return Napi::String::New(info.Env(), LoadedPath());
}

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  // process.once('exit'): after it, finalizers run inside Node's own teardown (common.h).
  Napi::Object process = env.Global().Get("process").As<Napi::Object>();
  process.Get("once").As<Napi::Function>().Call(
      process, {Napi::String::New(env, "exit"),
                Napi::Function::New(env, [](const Napi::CallbackInfo& info) -> Napi::Value {
                  MarkProcessExiting();
                  return info.Env().Undefined();
                })});
  exports.Set("load", Napi::Function::New<Load>(env, "load"));
  exports.Set("loadedPath", Napi::Function::New<LoadedPathJs>(env, "loadedPath"));
  exports.Set("NativeAgent", NativeAgent::Init(env));
  exports.Set("mapShared", Napi::Function::New<MapShared>(env, "mapShared"));
  exports.Set("unmapShared", Napi::Function::New<UnmapShared>(env, "unmapShared"));
  exports.Set("unlinkShared", Napi::Function::New<UnlinkShared>(env, "unlinkShared"));
  exports.Set("pinShared", Napi::Function::New<PinShared>(env, "pinShared"));
  exports.Set("bufferAddress", Napi::Function::New<BufferAddress>(env, "bufferAddress"));
  return exports;
}

}  // namespace
}  // namespace hnx

static Napi::Object InitModule(Napi::Env env, Napi::Object exports) { return hnx::Init(env, exports); }

NODE_API_MODULE(handoff_native, InitModule)
