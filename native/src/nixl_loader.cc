#include "nixl_loader.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <atomic>
#include <memory>
#include <mutex>

namespace hnx {
namespace {

std::mutex g_load_mutex;
std::atomic<const SymbolTable*> g_table{nullptr};
std::string g_path;  // guarded by g_load_mutex, written once

bool IsFile(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

LoadOutcome Fail(const char* code, std::string message, std::string path) {
  LoadOutcome out;
  out.code = code;
  out.message = std::move(message);
  out.path = std::move(path);
  return out;
}

}  // namespace

const SymbolTable* Nixl() { return g_table.load(std::memory_order_acquire); }

std::string LoadedPath() {
  std::lock_guard<std::mutex> lock(g_load_mutex);
  return g_path;
}

LoadOutcome LoadNixl(const std::string& dir) {
  std::lock_guard<std::mutex> lock(g_load_mutex);
  if (dir.empty() || dir[0] != '/') {
    return Fail("NAT_ERR_NIXL_NOT_AVAILABLE", "NIXL library directory must be an absolute path", dir);
  }
  // PR #2180 may rename the file to libnixl_capi.so.0; accept either, plain name first.
  std::string path = dir + "/libnixl_capi.so";
  if (!IsFile(path)) {
    const std::string alt = path + ".0";
    if (!IsFile(alt)) {
      return Fail("NAT_ERR_NIXL_NOT_AVAILABLE", "no libnixl_capi.so in " + dir, path);
    }
    path = alt;
  }
  if (g_table.load() != nullptr) {
    if (path == g_path) {
      LoadOutcome ok;
      ok.ok = true;
      ok.path = path;
      return ok;
    }
    return Fail("NAT_ERR_ALREADY_LOADED", "NIXL is already loaded from " + g_path, path);
  }

  // RTLD_LOCAL keeps NIXL's bundled UCX and abseil symbols out of the global namespace, where
  // they could clash with anything else the Node process loads.
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = ::dlerror();
    return Fail("NAT_ERR_NIXL_NOT_AVAILABLE", why ? why : "dlopen failed", path);
  }

  auto table = std::make_unique<SymbolTable>();
#define HNX_RESOLVE(member, ret, params)                                              \
  {                                                                                   \
    ::dlerror();                                                                      \
    void* sym = ::dlsym(handle, "nixl_capi_" #member);                                \
    if (sym == nullptr) {                                                             \
      ::dlclose(handle);                                                              \
      return Fail("NAT_ERR_NIXL_SYMBOL_MISSING", "symbol nixl_capi_" #member          \
                  " not found in the NIXL C API library", path);                      \
    }                                                                                 \
    table->member = reinterpret_cast<fn::member>(sym);                                \
  }
  HNX_NIXL_FUNCTIONS(HNX_RESOLVE)
#undef HNX_RESOLVE

  // The nixl-sys stub library exports the same names but forwards to a real one (or aborts);
  // only a real implementation may back the addon.
  if (table->is_stub()) {
    ::dlclose(handle);
    return Fail("NAT_ERR_NIXL_STUB", "the library at this path is the nixl-sys stub, not NIXL", path);
  }

  g_path = path;
  // Intentionally never dlclose()d or freed: NIXL keeps process-wide singletons alive.
  g_table.store(table.release(), std::memory_order_release);
  LoadOutcome ok;
  ok.ok = true;
  ok.path = path;
  return ok;
}

}  // namespace hnx
