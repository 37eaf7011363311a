// The compiled trampoline between PyTorch's pluggable CUDA allocator and a poollab policy.
//
// PyTorch calls a raw function pointer for every CUDA allocation and free
// (torch._C._cuda_customAllocator(malloc_ptr, free_ptr)): poollab_malloc / poollab_free below.
// Each takes the GIL, calls the hot path (realgpu.malloc_path.TorchPath) and returns: in the
// compiled build its C functions by address (poollab_set_entries: no Python call, the device
// argument not boxed, the stream's int boxed once while the stream stays), else one Python
// callable (realgpu.torch_allocator.AllocatorCore's malloc / free) by vectorcall. ctypes CFUNCTYPE
// callbacks cost 2.5-5.8 us a call (issue 30).
//
// Built at first use by realgpu.torch_allocator.load_shim (torch.utils.cpp_extension.load, cached
// in torch's extension folder). Needs no CUDA headers: the one CUDA runtime call (is the stream
// capturing a graph?) comes in as a function pointer that Python looks up in the loaded cudart.
//
// Errors: a refused request (a Python MemoryError, which PoolOutOfMemoryError is) is thrown as
// c10::OutOfMemoryError, which PyTorch turns into torch.OutOfMemoryError with this message; any
// other Python error becomes c10::Error (RuntimeError). A free never throws (PyTorch calls it
// from destructors): the Python side keeps its errors; a free arriving while the interpreter
// shuts down, or after the callbacks are cleared, does nothing (the driver reclaims the memory).
#include <Python.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>
#include <vector>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace {

PyObject* g_malloc_cb = nullptr;  // strong references, set by poollab_set_callbacks
PyObject* g_free_cb = nullptr;
// when nonzero, a refusal returns nullptr instead of throwing (mempool mode: PyTorch's caching
// allocator frees its cached blocks and retries, then raises its own OutOfMemoryError)
int g_null_on_refusal = 0;
// cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus*), or null
typedef int (*is_capturing_fn)(void*, int*);
is_capturing_fn g_is_capturing = nullptr;
// The compiled hot path's C entries (TorchPath.entry_addresses), called with g_target, a strong
// reference to the TorchPath: malloc(path, size, stream) -> the pointer (0 with the Python error
// set), free(path, ptr, size) -> None (a new reference, or NULL with the error set), free's pointer
// and size as C integers (no int boxed for them). Null: the callables above are called.
typedef unsigned long long (*malloc_entry_fn)(PyObject*, PyObject*, PyObject*);
typedef PyObject* (*free_entry_fn)(PyObject*, unsigned long long, unsigned long long);
PyObject* g_target = nullptr;
malloc_entry_fn g_malloc_entry = nullptr;
free_entry_fn g_free_entry = nullptr;
// The int of the last malloc's stream (a strong reference): nearly all of PyTorch's work is on one
// stream, so it is boxed once, not on every call.
void* g_stream = nullptr;
PyObject* g_stream_obj = nullptr;

// Per-call latency samples in the call clock's ticks (ns where read out), bounded: once full, every
// second sample is dropped and the stride doubles (so the kept samples stay evenly spread over the
// whole run). Kept sample i is always call i * stride (0-based): a reader picks a window of calls
// by it (counters 12 and 13 give the strides).
struct Samples {
  std::vector<int64_t> values;
  size_t capacity = size_t(1) << 21;
  uint64_t stride = 1;
  uint64_t seen = 0;

  // stride is a power of two: a mask, not a division, on every call (a 64-bit divide is tens of
  // cycles, twice a malloc/free pair)
  void add(int64_t ns) {
    uint64_t k = seen++;
    if (k & (stride - 1)) return;
    if (values.size() >= capacity) {
      size_t j = 0;
      for (size_t i = 0; i < values.size(); i += 2) values[j++] = values[i];
      values.resize(j);
      stride *= 2;
      if (k & (stride - 1)) return;
    }
    values.push_back(ns);
  }
  void clear() {
    values.clear();
    stride = 1;
    seen = 0;
  }
};

Samples g_alloc_ns, g_free_ns;
uint64_t g_num_zero = 0;    // 0-byte requests (answered here with nullptr, no policy call)
uint64_t g_num_ignored = 0; // frees that arrived with no callbacks or during shutdown
// Where a malloc's time goes, on every SPLIT_EVERY-th call (so that the split costs the others
// nothing): the capture check, taking the GIL and the one-at-a-time lock, the Python call, and
// giving the GIL back; ns summed over the split calls. And how many calls (malloc and free)
// arrived without the GIL (PyTorch's Python bindings let go of it before an op runs): those
// take it here, the dev benchmark's calls from Python find it held.
constexpr uint64_t SPLIT_EVERY = 16;
uint64_t g_num_split = 0;
int64_t g_split_capture_ns = 0, g_split_gil_ns = 0, g_split_call_ns = 0, g_split_release_ns = 0;
uint64_t g_num_no_gil = 0;
uint64_t g_num_capture_checks = 0;  // cudaStreamIsCapturing calls made (none on the null stream)

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// The clock a call is timed with (two reads a call, inside what PyTorch pays): the CPU's
// time-stamp counter where it ticks at a constant rate (constant_tsc and nonstop_tsc), the
// kernel's clock source is the TSC too, and it reads cheaper than clock_gettime (16-28 ns against
// 28-53 ns a read on the dev container's VM, by load), else CLOCK_MONOTONIC itself. Ticks become ns where they are read out, at the rate
// measured against CLOCK_MONOTONIC over the whole time since the clock was chosen (a clock read's
// error over seconds, so the samples are ns to a few parts in a million).
struct CallClock {
  bool tsc = false;
  int64_t ns0 = 0;
  int64_t tick0 = 0;

  inline int64_t ticks() const {
#if defined(__x86_64__)
    if (tsc) return int64_t(__rdtsc());
#endif
    return now_ns();
  }
  // ns per tick now (1 for CLOCK_MONOTONIC)
  double rate() const {
    if (!tsc) return 1.0;
    int64_t ns = now_ns(), t = ticks();
    return t > tick0 ? double(ns - ns0) / double(t - tick0) : 1.0;
  }
  int64_t to_ns(int64_t t, double r) const { return tsc ? int64_t(std::llround(double(t) * r)) : t; }

  static bool invariant_tsc() {
    FILE* f = std::fopen("/proc/cpuinfo", "r");
    if (f == nullptr) return false;
    char line[8192];
    bool constant = false, nonstop = false;
    while (std::fgets(line, sizeof line, f) != nullptr) {
      if (std::strncmp(line, "flags", 5) != 0) continue;
      constant = std::strstr(line, " constant_tsc") != nullptr;
      nonstop = std::strstr(line, " nonstop_tsc") != nullptr;
      break;
    }
    std::fclose(f);
    if (!constant || !nonstop) return false;
    // and the kernel keeps time with it (it leaves the TSC when it finds the cores' counters apart)
    f = std::fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource", "r");
    if (f == nullptr) return false;
    bool kernel_uses_it = std::fgets(line, sizeof line, f) != nullptr && std::strncmp(line, "tsc", 3) == 0;
    std::fclose(f);
    return kernel_uses_it;
  }

  void choose() {
#if defined(__x86_64__)
    if (invariant_tsc()) {
      volatile int64_t sink = 0;
      int64_t a = now_ns();
      for (int i = 0; i < 2000; ++i) sink += now_ns();
      int64_t b = now_ns();
      for (int i = 0; i < 2000; ++i) sink += int64_t(__rdtsc());
      int64_t c = now_ns();
      (void)sink;
      tsc = (c - b) < (b - a);
    }
#endif
    ns0 = now_ns();
    tick0 = ticks();
    if (tsc) {  // a first span for the rate, so that samples read at once convert well too
      while (now_ns() - ns0 < 2000000) {
      }
    }
  }
};

CallClock g_clock;
struct ChooseAtLoad {
  ChooseAtLoad() { g_clock.choose(); }  // when the library is loaded, before any call is timed
} g_choose_at_load;

bool interpreter_gone() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

// The current Python exception as "Type: message", cleared; whether it is a MemoryError.
std::string take_error(bool* is_memory_error) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  *is_memory_error = type != nullptr && PyErr_GivenExceptionMatches(type, PyExc_MemoryError);
  std::string text = "unknown error";
  if (value != nullptr) {
    PyObject* s = PyObject_Str(value);
    if (s != nullptr) {
      const char* c = PyUnicode_AsUTF8(s);
      if (c != nullptr) text = c;
      Py_DECREF(s);
    }
  }
  if (!*is_memory_error && type != nullptr) {
    text = std::string(reinterpret_cast<PyTypeObject*>(type)->tp_name) + ": " + text;
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return text;
}

// The stream's int, borrowed (GIL held); null with the error set if it cannot be made.
inline PyObject* stream_object(void* stream) {
  if (g_stream_obj == nullptr || stream != g_stream) {
    PyObject* obj = PyLong_FromVoidPtr(stream);
    if (obj == nullptr) return nullptr;
    Py_XDECREF(g_stream_obj);
    g_stream_obj = obj;
    g_stream = stream;
  }
  return g_stream_obj;
}

void clear_entries() {  // GIL held
  PyObject* old_target = g_target;
  PyObject* old_stream = g_stream_obj;
  g_target = nullptr;
  g_malloc_entry = nullptr;
  g_free_entry = nullptr;
  g_stream_obj = nullptr;
  g_stream = nullptr;
  Py_XDECREF(old_target);
  Py_XDECREF(old_stream);
}

struct Gil {
  PyGILState_STATE state;
  Gil() : state(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(state); }
};

// One callback at a time across threads (the policy's Python code is not thread-safe, and the GIL
// may pass to another thread in the middle of it). Taken with the GIL held: when another thread
// holds it, the GIL is let go while waiting, so that thread can finish. A call made on the same
// thread from inside a callback (a finalizer freeing a tensor while the policy allocates) goes
// through: the Python side queues such a free until the policy is done.
std::mutex g_call_mutex;
thread_local int t_depth = 0;

struct OneAtATime {
  bool locked = false;
  OneAtATime() {
    if (t_depth++ > 0) return;
    if (!g_call_mutex.try_lock()) {
      PyThreadState* save = PyEval_SaveThread();
      g_call_mutex.lock();
      PyEval_RestoreThread(save);
    }
    locked = true;
  }
  ~OneAtATime() {
    --t_depth;
    if (locked) g_call_mutex.unlock();
  }
};

}  // namespace

extern "C" {

// PyTorch's malloc: void* (size_t size, int device, cudaStream_t stream)
void* poollab_malloc(size_t size, int device, void* stream) {
  if (size == 0) {  // PyTorch's own allocator answers nullptr too; the free of nullptr is skipped
    ++g_num_zero;
    return nullptr;
  }
  int64_t t0 = g_clock.ticks();
  const bool split = g_alloc_ns.seen % SPLIT_EVERY == 0;
  // No graph is ever captured on the legacy null stream (cudaStreamBeginCapture refuses it), and
  // that is the stream of all of PyTorch's work unless it was told otherwise: no check there (a
  // runtime call on every malloc: issue 30's H200 run)
  if (g_is_capturing != nullptr && stream != nullptr) {
    ++g_num_capture_checks;
    int status = 0;
    if (g_is_capturing(stream, &status) == 0 && status != 0) {
      TORCH_CHECK(false, "poollab's pluggable allocator refuses CUDA graph capture: a captured graph keeps "
                  "its addresses after capture, and a pluggable allocator gets no begin/end-allocate-to-pool "
                  "hooks to keep them from being reused; use realgpu.torch_allocator.use_policy(..., "
                  "mode=\"mempool\") and torch.cuda.graph(g, pool=...) for graphs");
    }
  }
  void* ptr = nullptr;
  std::string error;
  bool is_memory_error = false;
  bool failed = false;
  int64_t t1 = split ? g_clock.ticks() : 0, t2 = 0, t3 = 0;
  if (!PyGILState_Check()) ++g_num_no_gil;
  {
    Gil gil;
    OneAtATime one;
    if (split) t2 = g_clock.ticks();
    if (g_malloc_cb == nullptr) {
      failed = true;
      error = "poollab allocator: malloc after the policy's pool was closed (PyTorch's own allocator "
              "cannot be put back in this process once a pluggable allocator was installed)";
    } else {
      if (g_malloc_entry != nullptr) {
        PyObject* target = g_target;  // held, and the stream's int: the call may rebind both
        PyObject* stream_obj = stream_object(stream);
        PyObject* size_obj = PyLong_FromSize_t(size);
        Py_INCREF(target);
        Py_XINCREF(stream_obj);
        unsigned long long answer = 0;
        if (stream_obj != nullptr && size_obj != nullptr) answer = g_malloc_entry(target, size_obj, stream_obj);
        Py_DECREF(target);
        Py_XDECREF(stream_obj);
        Py_XDECREF(size_obj);
        if (answer == 0 && PyErr_Occurred()) {
          failed = true;
          error = take_error(&is_memory_error);
        }
        ptr = reinterpret_cast<void*>(static_cast<uintptr_t>(answer));
      } else {
        PyObject* result = nullptr;
        PyObject* cb = g_malloc_cb;  // held: the callback may rebind the table while it runs
        Py_INCREF(cb);
        PyObject* args[3] = {PyLong_FromSize_t(size), PyLong_FromLong(device), PyLong_FromVoidPtr(stream)};
        result = PyObject_Vectorcall(cb, args, 3, nullptr);
        Py_DECREF(cb);
        Py_DECREF(args[0]);
        Py_DECREF(args[1]);
        Py_DECREF(args[2]);
        if (result == nullptr) {
          failed = true;
          error = take_error(&is_memory_error);
        } else {
          ptr = PyLong_AsVoidPtr(result);
          Py_DECREF(result);
          if (PyErr_Occurred()) {
            failed = true;
            error = take_error(&is_memory_error);
          }
        }
      }
    }
    if (split) t3 = g_clock.ticks();
  }
  int64_t t4 = g_clock.ticks();
  g_alloc_ns.add(t4 - t0);
  if (split) {
    ++g_num_split;
    g_split_capture_ns += t1 - t0;
    g_split_gil_ns += t2 - t1;
    g_split_call_ns += t3 - t2;
    g_split_release_ns += t4 - t3;
  }
  if (failed) {
    if (is_memory_error && g_null_on_refusal) return nullptr;
    if (is_memory_error) TORCH_CHECK_WITH(OutOfMemoryError, false, error);
    TORCH_CHECK(false, error);
  }
  return ptr;
}

// PyTorch's free: void (void* ptr, size_t size, int device, cudaStream_t stream)
void poollab_free(void* ptr, size_t size, int device, void* stream) {
  if (ptr == nullptr) return;  // what a 0-byte request got
  if (interpreter_gone()) {     // at shutdown: nothing to call, and nothing may raise
    ++g_num_ignored;
    return;
  }
  int64_t t0 = g_clock.ticks();
  if (!PyGILState_Check()) ++g_num_no_gil;
  {
    Gil gil;
    OneAtATime one;
    if (g_free_cb == nullptr) {
      ++g_num_ignored;
      return;
    }
    PyObject* result;
    PyObject* owner;  // what an error is reported against
    if (g_free_entry != nullptr) {
      owner = g_target;  // held: the call may rebind the table
      Py_INCREF(owner);
      result = g_free_entry(owner, static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(ptr)),
                            static_cast<unsigned long long>(size));
    } else {
      PyObject* args[4] = {PyLong_FromVoidPtr(ptr), PyLong_FromSize_t(size), PyLong_FromLong(device),
                           PyLong_FromVoidPtr(stream)};
      owner = g_free_cb;  // held: the callback may rebind the table while it runs
      Py_INCREF(owner);
      result = PyObject_Vectorcall(owner, args, 4, nullptr);
      for (PyObject* a : args) Py_DECREF(a);
    }
    if (result == nullptr) {
      PyErr_WriteUnraisable(owner);  // the Python side records its own errors; this is a bug there
    } else {
      Py_DECREF(result);
    }
    Py_DECREF(owner);
  }
  g_free_ns.add(g_clock.ticks() - t0);
}

// Install (or, with nulls, clear) the Python callables; clears the C entries (poollab_set_entries
// sets them after). Called through ctypes.PyDLL (GIL held).
void poollab_set_callbacks(PyObject* malloc_cb, PyObject* free_cb, int null_on_refusal) {
  clear_entries();
  Py_XINCREF(malloc_cb);
  Py_XINCREF(free_cb);
  PyObject* old_malloc = g_malloc_cb;
  PyObject* old_free = g_free_cb;
  g_malloc_cb = malloc_cb == Py_None ? nullptr : malloc_cb;
  g_free_cb = free_cb == Py_None ? nullptr : free_cb;
  if (malloc_cb == Py_None) Py_DECREF(malloc_cb);
  if (free_cb == Py_None) Py_DECREF(free_cb);
  g_null_on_refusal = null_on_refusal;
  Py_XDECREF(old_malloc);
  Py_XDECREF(old_free);
}

// Call the compiled hot path's C functions (TorchPath.entry_addresses) with `target` instead of the
// callables (which stay installed: a null callable still means closed). Called through ctypes.PyDLL
// (GIL held), after poollab_set_callbacks.
void poollab_set_entries(PyObject* target, void* malloc_fn, void* free_fn) {
  clear_entries();
  if (target == Py_None || malloc_fn == nullptr || free_fn == nullptr) return;
  Py_INCREF(target);
  g_target = target;
  g_malloc_entry = reinterpret_cast<malloc_entry_fn>(malloc_fn);
  g_free_entry = reinterpret_cast<free_entry_fn>(free_fn);
}

// 1 when the C entries are installed (tests: which way the trampoline calls).
int poollab_uses_entries() { return g_malloc_entry != nullptr ? 1 : 0; }

void poollab_set_capture_check(void* fn) { g_is_capturing = reinterpret_cast<is_capturing_fn>(fn); }

// Copy up to n samples (kind 0: malloc, 1: free) into out; returns how many are kept.
size_t poollab_samples(int kind, int64_t* out, size_t n) {
  const Samples& s = kind == 0 ? g_alloc_ns : g_free_ns;
  size_t k = s.values.size() < n ? s.values.size() : n;
  const double r = g_clock.rate();
  for (size_t i = 0; i < k; ++i) out[i] = g_clock.to_ns(s.values[i], r);
  return s.values.size();
}

// Counters: 0 mallocs seen, 1 frees seen, 2 zero-byte requests, 3 ignored frees, 4 calls that
// arrived without the GIL, 5 capture checks made, 6 split mallocs, then the split's ns sums:
// 7 capture check, 8 taking the GIL and the lock, 9 the Python call, 10 giving the GIL back;
// 11: 1 when calls are timed with the time-stamp counter, 0 with CLOCK_MONOTONIC; 12 and 13: the
// malloc and free samples' strides (kept sample i is call i * stride).
uint64_t poollab_counter(int which) {
  switch (which) {
    case 0: return g_alloc_ns.seen;
    case 1: return g_free_ns.seen;
    case 2: return g_num_zero;
    case 3: return g_num_ignored;
    case 4: return g_num_no_gil;
    case 5: return g_num_capture_checks;
    case 6: return g_num_split;
    case 7: return uint64_t(g_clock.to_ns(g_split_capture_ns, g_clock.rate()));
    case 8: return uint64_t(g_clock.to_ns(g_split_gil_ns, g_clock.rate()));
    case 9: return uint64_t(g_clock.to_ns(g_split_call_ns, g_clock.rate()));
    case 10: return uint64_t(g_clock.to_ns(g_split_release_ns, g_clock.rate()));
    case 11: return g_clock.tsc ? 1 : 0;
    case 12: return g_alloc_ns.stride;
    case 13: return g_free_ns.stride;
    default: return 0;
  }
}

// Samples kept per kind before thinning (tests: a small one thins after a few calls); clears them.
void poollab_set_sample_capacity(size_t n) {
  g_alloc_ns.clear();
  g_free_ns.clear();
  g_alloc_ns.capacity = g_free_ns.capacity = n < 2 ? 2 : n;
}

void poollab_reset_counters() {
  g_alloc_ns.clear();
  g_free_ns.clear();
  g_num_zero = 0;
  g_num_ignored = 0;
  g_num_split = 0;
  g_split_capture_ns = g_split_gil_ns = g_split_call_ns = g_split_release_ns = 0;
  g_num_no_gil = 0;
  g_num_capture_checks = 0;
}

// What the trampoline's own steps cost on this machine, ns for n calls: kind 0 the call clock's
// read (two a call), kind 1 the capture check on `stream` (-1: none is set), kind 2 a
// clock_gettime(CLOCK_MONOTONIC) read.
int64_t poollab_time_steps(int kind, void* stream, int64_t n) {
  if (kind == 1 && g_is_capturing == nullptr) return -1;
  int64_t t0 = now_ns();
  volatile int64_t sink = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (kind == 0) {
      sink += g_clock.ticks();
    } else if (kind == 2) {
      sink += now_ns();
    } else {
      int status = 0;
      sink += g_is_capturing(stream, &status);
    }
  }
  (void)sink;
  return now_ns() - t0;
}

// For tests without a GPU: call poollab_malloc as PyTorch would, catching what it throws.
// Returns 0 and the pointer, 1 for c10::OutOfMemoryError, 2 for another c10::Error; message in buf.
int poollab_probe_malloc(size_t size, void* stream, void** out, char* buf, size_t buflen) {
  try {
    *out = poollab_malloc(size, 0, stream);
    return 0;
  } catch (const c10::OutOfMemoryError& e) {
    snprintf(buf, buflen, "%s", e.what_without_backtrace());
    return 1;
  } catch (const c10::Error& e) {
    snprintf(buf, buflen, "%s", e.what_without_backtrace());
    return 2;
  }
}

}  // extern "C"
