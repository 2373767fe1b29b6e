// The addon's own declarations of the NIXL C API (`libnixl_capi.so`).
//
// NIXL ships no header for its C API in any registry package, so these are written by hand
// from the prototypes in the nixl-sys crate's wrapper.h (v1.5.1). test/native/decls.test.ts
// compiles test/native/decls-check.cc, which static_asserts every entry below against that
// header, so drift is caught whenever the pinned NIXL version changes. The header itself is
// never part of this repository.
//
// Nothing here is linked: the addon dlopen()s the library by absolute path and resolves each
// entry with dlsym() into a SymbolTable (nixl_loader.h).
#pragma once

#include <cstddef>
#include <cstdint>

namespace hnx {

// C status codes. They are NOT the C++ nixl_status_t numbers: the C layer folds most C++
// errors (REMOTE_DISCONNECT included) into kErrBackend. kErrNotFound exists from v1.5.
enum Status : int {
  kSuccess = 0,
  kInProg = 1,
  kErrInvalidParam = -1,
  kErrBackend = -2,
  kErrInvalidState = -3,
  kErrException = -4,
  kErrNoTelemetry = -5,
  kErrNotFound = -6,
};

enum MemType : int {
  kMemDram = 0,
  kMemVram = 1,
  kMemBlock = 2,
  kMemObject = 3,
  kMemFile = 4,
  kMemUnknown = 5,
};

enum XferOp : int {
  kXferRead = 0,
  kXferWrite = 1,
};

enum ThreadSync : int {
  kSyncNone = 0,
  kSyncStrict = 1,
  kSyncRw = 2,
};

// Layout must match nixl_capi_agent_config_t exactly (checked field by field by the
// compile test): it is passed by pointer, and NIXL does not version it.
struct AgentConfig {
  bool enable_prog_thread;
  bool enable_listen_thread;
  int listen_port;
  ThreadSync thread_sync;
  unsigned int num_workers;
  uint64_t pthr_delay_us;
  uint64_t lthr_delay_us;
  bool capture_telemetry;
};

// Opaque handles; only ever used through pointers.
struct AgentS;
struct ParamsS;
struct MemListS;
struct StringListS;
struct BackendS;
struct OptArgsS;
struct ParamIterS;
struct XferDlistS;
struct RegDlistS;
struct XferReqS;
struct NotifMapS;
struct XferDlistHandleS;

using Agent = AgentS*;
using Params = ParamsS*;
using MemList = MemListS*;
using StringList = StringListS*;
using Backend = BackendS*;
using OptArgs = OptArgsS*;
using ParamIter = ParamIterS*;
using XferDlist = XferDlistS*;
using RegDlist = RegDlistS*;
using XferReq = XferReqS*;
using NotifMap = NotifMapS*;
using XferDlistHandle = XferDlistHandleS*;

// X-macro: (name without the nixl_capi_ prefix, return type, parameter list). One list drives the
// symbol table, the dlsym loop and the compile-time check, so they cannot disagree.
#define HNX_NIXL_FUNCTIONS(X)                                                                 \
  X(create_agent, Status, (const char* name, Agent* agent))                                  \
  X(create_configured_agent, Status, (const char* name, const AgentConfig* cfg, Agent* agent)) \
  X(destroy_agent, Status, (Agent agent))                                                     \
  X(get_available_plugins, Status, (Agent agent, StringList* plugins))                       \
  X(string_list_size, Status, (StringList list, size_t* size))                               \
  X(string_list_get, Status, (StringList list, size_t index, const char** str))              \
  X(destroy_string_list, Status, (StringList list))                                          \
  X(get_plugin_params, Status, (Agent agent, const char* plugin, MemList* mems, Params* params)) \
  X(get_backend_params, Status, (Agent agent, Backend backend, MemList* mems, Params* params)) \
  X(destroy_mem_list, Status, (MemList list))                                                \
  X(mem_list_size, Status, (MemList list, size_t* size))                                     \
  X(mem_list_get, Status, (MemList list, size_t index, MemType* mem_type))                   \
  X(create_params, Status, (Params* params))                                                 \
  X(params_add, Status, (Params params, const char* key, const char* value))                 \
  X(params_is_empty, Status, (Params params, bool* is_empty))                                \
  X(params_create_iterator, Status, (Params params, ParamIter* iter))                        \
  X(params_iterator_next, Status,                                                            \
    (ParamIter iter, const char** key, const char** value, bool* has_next))                  \
  X(params_destroy_iterator, Status, (ParamIter iter))                                       \
  X(destroy_params, Status, (Params params))                                                 \
  X(create_backend, Status, (Agent agent, const char* plugin, Params params, Backend* backend)) \
  X(destroy_backend, Status, (Backend backend))                                              \
  X(create_opt_args, Status, (OptArgs* args))                                                \
  X(destroy_opt_args, Status, (OptArgs args))                                                \
  X(opt_args_add_backend, Status, (OptArgs args, Backend backend))                           \
  X(opt_args_set_notif_msg, Status, (OptArgs args, const void* data, size_t len))            \
  X(opt_args_set_has_notif, Status, (OptArgs args, bool has_notif))                          \
  X(create_reg_dlist, Status, (MemType mem_type, RegDlist* dlist))                           \
  X(reg_dlist_add_desc, Status,                                                              \
    (RegDlist dlist, uintptr_t addr, size_t len, uint64_t dev_id, const void* meta,          \
     size_t meta_len))                                                                       \
  X(destroy_reg_dlist, Status, (RegDlist dlist))                                             \
  X(register_mem, Status, (Agent agent, RegDlist dlist, OptArgs opt_args))                   \
  X(deregister_mem, Status, (Agent agent, RegDlist dlist, OptArgs opt_args))                 \
  X(get_local_md, Status, (Agent agent, void** data, size_t* len))                           \
  X(get_local_partial_md, Status,                                                            \
    (Agent agent, RegDlist descs, void** data, size_t* len, OptArgs opt_args))               \
  X(load_remote_md, Status, (Agent agent, const void* data, size_t len, char** agent_name))  \
  X(invalidate_remote_md, Status, (Agent agent, const char* remote_agent))                   \
  X(check_remote_md, Status, (Agent agent, const char* remote_name, XferDlist descs))        \
  X(create_xfer_dlist, Status, (MemType mem_type, XferDlist* dlist))                         \
  X(xfer_dlist_add_desc, Status, (XferDlist dlist, uintptr_t addr, size_t len, uint64_t dev_id)) \
  X(destroy_xfer_dlist, Status, (XferDlist dlist))                                           \
  X(create_xfer_req, Status,                                                                 \
    (Agent agent, XferOp op, XferDlist local, XferDlist remote, const char* remote_agent,    \
     XferReq* req, OptArgs opt_args))                                                        \
  X(post_xfer_req, Status, (Agent agent, XferReq req, OptArgs opt_args))                     \
  X(get_xfer_status, Status, (Agent agent, XferReq req))                                     \
  X(release_xfer_req, Status, (Agent agent, XferReq req))                                    \
  X(destroy_xfer_req, Status, (XferReq req))                                                 \
  X(prep_xfer_dlist, Status,                                                                 \
    (Agent agent, const char* agent_name, XferDlist descs, XferDlistHandle* handle,          \
     OptArgs opt_args))                                                                      \
  X(release_xfer_dlist_handle, Status, (Agent agent, XferDlistHandle handle))                \
  X(make_xfer_req, Status,                                                                   \
    (Agent agent, XferOp op, XferDlistHandle local, const int* local_indices,                \
     size_t local_count, XferDlistHandle remote, const int* remote_indices,                  \
     size_t remote_count, XferReq* req, OptArgs opt_args))                                   \
  X(gen_notif, Status,                                                                       \
    (Agent agent, const char* remote_agent, const void* data, size_t len, OptArgs opt_args)) \
  X(create_notif_map, Status, (NotifMap* map))                                               \
  X(destroy_notif_map, Status, (NotifMap map))                                               \
  X(get_notifs, Status, (Agent agent, NotifMap map, OptArgs opt_args))                       \
  X(notif_map_size, Status, (NotifMap map, size_t* size))                                    \
  X(notif_map_get_agent_at, Status, (NotifMap map, size_t index, const char** agent_name))   \
  X(notif_map_get_notifs_size, Status, (NotifMap map, const char* agent_name, size_t* size)) \
  X(notif_map_get_notif, Status,                                                             \
    (NotifMap map, const char* agent_name, size_t index, const void** data, size_t* len))    \
  X(notif_map_clear, Status, (NotifMap map))                                                 \
  X(is_stub, bool, ())

// Function-pointer types, e.g. hnx::fn::create_agent.
namespace fn {
#define HNX_DECLARE_FN_TYPE(member, ret, params) using member = ret(*) params;
HNX_NIXL_FUNCTIONS(HNX_DECLARE_FN_TYPE)
#undef HNX_DECLARE_FN_TYPE
}  // namespace fn

}  // namespace hnx
