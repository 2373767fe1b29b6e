// Compile-time check of native/src/nixl_api.h against NIXL's own C prototypes.
//
// Built by test/native/decls.test.ts with `g++ -fsyntax-only -I<dir holding wrapper.h>`; the
// header comes from the nixl-sys crate of the NIXL version in use and is never committed.
// Every entry of HNX_NIXL_FUNCTIONS is translated, type by type, into NIXL's names and must
// equal decltype(&nixl_capi_<name>) exactly.
#include "wrapper.h"

#include <cstddef>
#include <type_traits>

#include "nixl_api.h"

namespace {

// Map<T>: the addon's type T spelled with wrapper.h's types. Pointers and const are mapped
// through, so `const hnx::AgentConfig*` becomes `const nixl_capi_agent_config_t*`.
template <typename T> struct Map { using type = T; };
template <typename T> using MapT = typename Map<T>::type;
template <typename T> struct Map<T*> { using type = MapT<T>*; };
template <typename T> struct Map<const T> { using type = const MapT<T>; };
template <typename R, typename... A> struct Map<R (*)(A...)> { using type = MapT<R> (*)(MapT<A>...); };

#define HNX_MAP(mine, theirs) \
  template <> struct Map<mine> { using type = theirs; };
HNX_MAP(hnx::Status, nixl_capi_status_t)
HNX_MAP(hnx::MemType, nixl_capi_mem_type_t)
HNX_MAP(hnx::XferOp, nixl_capi_xfer_op_t)
HNX_MAP(hnx::ThreadSync, nixl_capi_thread_sync_t)
HNX_MAP(hnx::AgentConfig, nixl_capi_agent_config_t)
HNX_MAP(hnx::AgentS, nixl_capi_agent_s)
HNX_MAP(hnx::ParamsS, nixl_capi_params_s)
HNX_MAP(hnx::MemListS, nixl_capi_mem_list_s)
HNX_MAP(hnx::StringListS, nixl_capi_string_list_s)
HNX_MAP(hnx::BackendS, nixl_capi_backend_s)
HNX_MAP(hnx::OptArgsS, nixl_capi_opt_args_s)
HNX_MAP(hnx::ParamIterS, nixl_capi_param_iter_s)
HNX_MAP(hnx::XferDlistS, nixl_capi_xfer_dlist_s)
HNX_MAP(hnx::RegDlistS, nixl_capi_reg_dlist_s)
HNX_MAP(hnx::XferReqS, nixl_capi_xfer_req_s)
HNX_MAP(hnx::NotifMapS, nixl_capi_notif_map_s)
HNX_MAP(hnx::XferDlistHandleS, nixl_capi_xfer_dlist_handle_s)
#undef HNX_MAP

#define HNX_CHECK_FN(member, ret, params)                                              \
  static_assert(std::is_same_v<MapT<hnx::fn::member>, decltype(&nixl_capi_##member)>, \
                "nixl_api.h disagrees with wrapper.h on nixl_capi_" #member);
HNX_NIXL_FUNCTIONS(HNX_CHECK_FN)
#undef HNX_CHECK_FN

// Enum values the addon relies on (compared as int: the enums are distinct types).
#define HNX_SAME_VALUE(mine, theirs) \
  static_assert(static_cast<int>(mine) == static_cast<int>(theirs), #mine " != " #theirs);
HNX_SAME_VALUE(hnx::kSuccess, NIXL_CAPI_SUCCESS)
HNX_SAME_VALUE(hnx::kInProg, NIXL_CAPI_IN_PROG)
HNX_SAME_VALUE(hnx::kErrInvalidParam, NIXL_CAPI_ERROR_INVALID_PARAM)
HNX_SAME_VALUE(hnx::kErrBackend, NIXL_CAPI_ERROR_BACKEND)
HNX_SAME_VALUE(hnx::kErrInvalidState, NIXL_CAPI_ERROR_INVALID_STATE)
HNX_SAME_VALUE(hnx::kErrException, NIXL_CAPI_ERROR_EXCEPTION)
HNX_SAME_VALUE(hnx::kErrNoTelemetry, NIXL_CAPI_ERROR_NO_TELEMETRY)
// NOT_FOUND (-6) only exists from v1.5 (PR #2114); the test defines this when it applies.
#ifdef HNX_EXPECT_NOT_FOUND
HNX_SAME_VALUE(hnx::kErrNotFound, NIXL_CAPI_ERROR_NOT_FOUND)
#endif
HNX_SAME_VALUE(hnx::kMemDram, NIXL_CAPI_MEM_DRAM)
HNX_SAME_VALUE(hnx::kMemVram, NIXL_CAPI_MEM_VRAM)
HNX_SAME_VALUE(hnx::kXferRead, NIXL_CAPI_XFER_OP_READ)
HNX_SAME_VALUE(hnx::kSyncNone, NIXL_CAPI_THREAD_SYNC_NONE)
HNX_SAME_VALUE(hnx::kSyncStrict, NIXL_CAPI_THREAD_SYNC_STRICT)
HNX_SAME_VALUE(hnx::kSyncRw, NIXL_CAPI_THREAD_SYNC_RW)
#undef HNX_SAME_VALUE
static_assert(sizeof(hnx::Status) == sizeof(nixl_capi_status_t));
static_assert(sizeof(hnx::MemType) == sizeof(nixl_capi_mem_type_t));

// The config struct travels by pointer, so its layout must match field for field.
#define HNX_SAME_FIELD(f)                                                                   \
  static_assert(offsetof(hnx::AgentConfig, f) == offsetof(nixl_capi_agent_config_t, f) &&  \
                sizeof(hnx::AgentConfig::f) == sizeof(nixl_capi_agent_config_t::f),         \
                "AgentConfig." #f " layout differs");
HNX_SAME_FIELD(enable_prog_thread)
HNX_SAME_FIELD(enable_listen_thread)
HNX_SAME_FIELD(listen_port)
HNX_SAME_FIELD(thread_sync)
HNX_SAME_FIELD(num_workers)
HNX_SAME_FIELD(pthr_delay_us)
HNX_SAME_FIELD(lthr_delay_us)
HNX_SAME_FIELD(capture_telemetry)
#undef HNX_SAME_FIELD
static_assert(sizeof(hnx::AgentConfig) == sizeof(nixl_capi_agent_config_t));

}  // namespace

// Self-test: the test compiles once with this defined and expects failure, proving that a
// mismatch is caught at all.
#ifdef HNX_SELFTEST_MISMATCH
static_assert(std::is_same_v<MapT<hnx::fn::destroy_agent>, decltype(&nixl_capi_create_agent)>,
              "self-test: a deliberate mismatch");
#endif
