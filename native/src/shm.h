// POSIX shared memory mapped into ArrayBuffers (a simulator and its agent share one region).
#pragma once

#include <napi.h>

namespace hnx {

// mapShared(name, size, create, exclusive, lock) -> ArrayBuffer
Napi::Value MapShared(const Napi::CallbackInfo& info);
// unmapShared(ArrayBuffer) -> boolean: detaches the buffer and unmaps it now.
Napi::Value UnmapShared(const Napi::CallbackInfo& info);
// unlinkShared(name) -> boolean (false when it did not exist)
Napi::Value UnlinkShared(const Napi::CallbackInfo& info);
// pinShared(addr, len, delta) -> boolean: counts NIXL registrations over a mapping (false when
// the range is not inside one); unmapShared refuses while the count is positive.
Napi::Value PinShared(const Napi::CallbackInfo& info);
// bufferAddress(ArrayBuffer | TypedArray | DataView) -> bigint
Napi::Value BufferAddress(const Napi::CallbackInfo& info);

}  // namespace hnx
