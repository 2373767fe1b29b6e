#include "shm.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "common.h"

namespace hnx {
namespace {

// A live mapping. Finalizers and unmapShared both end here, so the pages are unmapped once;
// an unmapped address can be reused by the kernel, and a second munmap would hit that.
struct Mapping {
  void* addr;
  size_t len;
  // NIXL registrations over this mapping (pinShared). While any exists, unmapShared refuses:
  // a READ may be writing into the pages (issue #7, item 2).
  int pins = 0;
  // Which mapping this is. After unmapShared the kernel may hand the same address to the next
  // mmap; the old ArrayBuffer's finalizer (it runs at some later GC) must then leave the new
  // mapping alone instead of unmapping it.
  uint64_t generation = 0;
  // With the lock option: the descriptor holding flock(LOCK_EX) on the object, closed (and so
  // unlocked) when the mapping goes. -1 without a lock.
  int lock_fd = -1;
};

void Release(const Mapping& m) {
  ::munmap(m.addr, m.len);
  if (m.lock_fd >= 0) ::close(m.lock_fd);
}
uint64_t g_next_generation = 1;
std::mutex g_maps_mutex;
std::map<void*, Mapping> g_maps;

// generation 0: whichever mapping is at addr.
bool Forget(void* addr, Mapping* out, uint64_t generation = 0) {
  std::lock_guard<std::mutex> lock(g_maps_mutex);
  auto it = g_maps.find(addr);
  if (it == g_maps.end()) return false;
  if (generation != 0 && it->second.generation != generation) return false;
  *out = it->second;
  g_maps.erase(it);
  return true;
}

// The mapping holding [addr, addr + len), or end(). Caller holds g_maps_mutex.
std::map<void*, Mapping>::iterator Containing(uintptr_t addr, size_t len) {
  auto it = g_maps.upper_bound(reinterpret_cast<void*>(addr));
  if (it == g_maps.begin()) return g_maps.end();
  --it;
  const uintptr_t start = reinterpret_cast<uintptr_t>(it->second.addr);
  if (addr >= start && addr + len <= start + it->second.len) return it;
  return g_maps.end();
}

Napi::Error ShmError(Napi::Env env, const std::string& what, int err) {
  Napi::Error e = Napi::Error::New(env, what + ": " + std::strerror(err));
  e.Set("code", Napi::String::New(env, "NAT_ERR_SHM"));
  e.Set("errno", Napi::Number::New(env, err));
  return e;
}

// POSIX names are "/name" with no further slash (shm_overview(7)).
std::string NameArg(const Napi::CallbackInfo& info) {
  if (info.Length() < 1 || !info[0].IsString()) throw ArgError(info.Env(), "shared memory name must be a string");
  std::string name = info[0].As<Napi::String>().Utf8Value();
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > 250) {
    throw ArgError(info.Env(), "shared memory name must look like /name (no other slash)");
  }
  return name;
}

}  // namespace

Napi::Value MapShared(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string name = NameArg(info);
  if (info.Length() < 2 || !info[1].IsNumber()) throw ArgError(env, "size must be a number");
  const double want = info[1].As<Napi::Number>().DoubleValue();
  const bool create = info.Length() > 2 && info[2].ToBoolean().Value();
  const bool exclusive = info.Length() > 3 && info[3].ToBoolean().Value();
  // One holder per object across processes: an agent must never map a region another agent
  // has attached (issue 18). A lock on the open file description, so any process that opens
  // the object again, this one included, is refused until the mapping is released.
  const bool lock = info.Length() > 4 && info[4].ToBoolean().Value();
  if (!(want >= 0) || want > 1e15 || (create && !(want > 0))) throw ArgError(env, "size must be a positive byte count");

  int flags = O_RDWR;
  if (create) flags |= O_CREAT;
  if (exclusive) flags |= O_EXCL;
  const int fd = ::shm_open(name.c_str(), flags, 0600);
  if (fd < 0) throw ShmError(env, "shm_open " + name, errno);
  size_t len = static_cast<size_t>(want);
  struct stat st;
  if (lock && ::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    ::close(fd);
    throw ShmError(env, "region " + name + " is held by another mapping (flock)", err);
  }
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw ShmError(env, "fstat " + name, err);
  }
  if (create && static_cast<size_t>(st.st_size) < len) {
    if (::ftruncate(fd, static_cast<off_t>(len)) != 0) {
      int err = errno;
      ::close(fd);
      throw ShmError(env, "ftruncate " + name, err);
    }
  } else if (len == 0) {
    len = static_cast<size_t>(st.st_size);  // open an existing region at its full size
  } else if (static_cast<size_t>(st.st_size) < len) {
    ::close(fd);
    throw ShmError(env, "region " + name + " is smaller than requested", EINVAL);
  }
  if (len == 0) {
    ::close(fd);
    throw ShmError(env, "region " + name + " is empty", EINVAL);
  }
  void* addr = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_err = errno;
  if (addr == MAP_FAILED) {
    ::close(fd);
    throw ShmError(env, "mmap " + name, map_err);
  }
  // The mapping keeps the object alive; the descriptor stays open only to hold the lock.
  int lock_fd = -1;
  if (lock) lock_fd = fd;
  else ::close(fd);
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(g_maps_mutex);
    generation = g_next_generation++;
    g_maps[addr] = Mapping{addr, len, 0, generation, lock_fd};
  }
  return Napi::ArrayBuffer::New(env, addr, len, [generation](Napi::Env, void* data) {
    Mapping m;
    if (Forget(data, &m, generation)) Release(m);
  });
}

Napi::Value UnmapShared(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 1 || !info[0].IsArrayBuffer()) throw ArgError(env, "expected the ArrayBuffer from mapShared");
  Napi::ArrayBuffer ab = info[0].As<Napi::ArrayBuffer>();
  if (ab.IsDetached()) return Napi::Boolean::New(env, false);
  void* addr = ab.Data();
  {
    std::lock_guard<std::mutex> lock(g_maps_mutex);
    auto it = g_maps.find(addr);
    if (it != g_maps.end() && it->second.pins > 0) {
      Napi::Error e = Napi::Error::New(env, "shared memory is registered with a NIXL agent (" +
                                                std::to_string(it->second.pins) + " registration(s)); deregister it first");
      e.Set("code", Napi::String::New(env, "NAT_ERR_MEMORY_IN_USE"));
      throw e;
    }
  }
  Mapping m;
  if (!Forget(addr, &m)) return Napi::Boolean::New(env, false);
  // Detach first so no JS view can touch the pages once they are gone.
  ab.Detach();
  Release(m);
  return Napi::Boolean::New(env, true);
}

Napi::Value UnlinkShared(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  std::string name = NameArg(info);
  if (::shm_unlink(name.c_str()) == 0) return Napi::Boolean::New(env, true);
  if (errno == ENOENT) return Napi::Boolean::New(env, false);
  throw ShmError(env, "shm_unlink " + name, errno);
}

Napi::Value PinShared(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 3 || !info[0].IsBigInt() || !info[1].IsNumber() || !info[2].IsNumber()) {
    throw ArgError(env, "pinShared(addr: bigint, len: number, delta: number)");
  }
  bool lossless = true;
  const uint64_t addr = info[0].As<Napi::BigInt>().Uint64Value(&lossless);
  const size_t len = static_cast<size_t>(info[1].As<Napi::Number>().DoubleValue());
  const int delta = info[2].As<Napi::Number>().Int32Value();
  std::lock_guard<std::mutex> lock(g_maps_mutex);
  auto it = Containing(static_cast<uintptr_t>(addr), len);
  if (it == g_maps.end()) return Napi::Boolean::New(env, false);
  it->second.pins = std::max(0, it->second.pins + delta);
  return Napi::Boolean::New(env, true);
}

Napi::Value BufferAddress(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 1) throw ArgError(env, "expected a buffer");
  uintptr_t addr = 0;
  if (info[0].IsArrayBuffer()) {
    addr = reinterpret_cast<uintptr_t>(info[0].As<Napi::ArrayBuffer>().Data());
  } else if (info[0].IsTypedArray()) {
    auto ta = info[0].As<Napi::TypedArray>();
    addr = reinterpret_cast<uintptr_t>(ta.ArrayBuffer().Data()) + ta.ByteOffset();
  } else if (info[0].IsDataView()) {
    auto dv = info[0].As<Napi::DataView>();
    addr = reinterpret_cast<uintptr_t>(dv.ArrayBuffer().Data()) + dv.ByteOffset();
  } else {
    throw ArgError(env, "expected an ArrayBuffer, TypedArray or DataView");
  }
  return Napi::BigInt::New(env, static_cast<uint64_t>(addr));
}

}  // namespace hnx
