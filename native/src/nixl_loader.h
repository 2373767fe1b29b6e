// Run-time loading of libnixl_capi.so: dlopen by absolute path, dlsym into one table.
#pragma once

#include <string>

#include "nixl_api.h"

namespace hnx {

// One resolved pointer per entry of HNX_NIXL_FUNCTIONS; never partially filled.
struct SymbolTable {
#define HNX_TABLE_MEMBER(member, ret, params) fn::member member = nullptr;
  HNX_NIXL_FUNCTIONS(HNX_TABLE_MEMBER)
#undef HNX_TABLE_MEMBER
};

struct LoadOutcome {
  bool ok = false;
  std::string code;     // NAT_ERR_* when !ok
  std::string message;  // human detail (dlerror text, missing symbol, ...)
  std::string path;     // the file that was (or would have been) opened
};

// The library is process-wide state by nature (dlopen handles and NIXL's plugin manager are
// singletons), so the table is too. Returns nullptr until LoadNixl succeeds.
const SymbolTable* Nixl();
std::string LoadedPath();

// Thread-safe; a second call with the same directory is a no-op, with another directory an
// error (one process must never map two NIXL or UCX copies).
LoadOutcome LoadNixl(const std::string& dir);

}  // namespace hnx
