// GroupNorm with a fused activation, for NCHW and channels-last input, in the input's layout.
//
// Four schemes, chosen by make_plan:
//  - fused: one block per (sample, group) holds the whole group in registers; exact two-pass
//    statistics, then normalize. Small groups (the deep U-Net levels).
//  - resident (tensors that fit in the shared memory of the whole GPU): one cooperative kernel,
//    one block per multiprocessor; each block copies its part of x into shared memory, writes the
//    shifted sums of its groups to the workspace, waits at a grid barrier, combines the sums of
//    the blocks that share its groups and normalizes from shared memory. x is read once and y
//    written once.
//    Channels-last blocks own rows of pixels (all groups); NCHW blocks own spans of one group.
//    It replaced a Hopper thread-block-cluster kernel (pixels in registers, group sums through
//    distributed shared memory) that was no faster at 2x640x32x32 and slower at larger sizes.
//  - split: a stats kernel writes the moments of chunks of each group, a finalize kernel merges
//    them into (mean, rstd) per group, an apply kernel normalizes (its re-read of x mostly hits
//    L2). Merging once, rather than in every apply block, keeps the merge work independent of
//    the number of blocks.
//    Each stats/apply thread handles one unrolled batch, so the whole tensor is in flight at once.
//    Channels-last ("nhwc" layout of the split kernels): blocks own a tile of whole groups'
//    channels over a chunk of pixels, so a thread keeps one channel vector and reads full rows.
//    NCHW, and channels-last groups too wide for a tile ("groups" layout): chunks of each
//    group's own span.
#include <algorithm>
#include <numeric>
#include <type_traits>

#include <cooperative_groups.h>
#include <cuda_pipeline.h>

#include "group_norm.cuh"
#include "kernel_utils.cuh"

namespace mirage::cuda {
namespace {

constexpr int kFusedThreads = 512;
constexpr int kFusedMaxPerThread = 8;  // vectors per thread in registers
// Larger groups go split. Measured on an H200 (docs/perf/norms.md): up to this size one kernel
// with a block per group beats three kernels over the whole chip, idle multiprocessors and all.
constexpr int kFusedMaxVecs = kFusedThreads * kFusedMaxPerThread;
constexpr int kSplitThreads = 256;
constexpr int kUnroll = 4;             // independent loads in flight per thread
constexpr int kMaxTileVecs = 128;      // nhwc: column vectors per block
constexpr int kMaxFusedChannels = 4096;  // fused: the group's scale and shift live in shared memory

enum class Path { kFused, kResidentPixels, kResidentSpans, kNhwc, kGroups };
constexpr int kMaxChunks = 1024;  // split: chunks per group (bounds the finalize work)
constexpr int kFinalizeWarps = 8;
// resident: one block of this many threads per multiprocessor (64 registers a thread at most).
constexpr int kResidentThreads = 1024;
// NCHW groups above this many vectors take the resident path even when the fused kernel fits.
// Measured on an H200 (docs/perf/norms.md): 2x640x32x32 (2560 vectors a group) 15.0 us fused.
constexpr int64_t kSpansMinVecs = 2048;
// The resident channels-last kernel's merge holds a group's sums from this many blocks at most in
// registers (a warp's lanes, kMaxPixelChunks / 32 each).
constexpr int kMaxPixelChunks = 160;

// The resident channels-last kernel's stride between the V planes of its lanes' sums: padded to
// 2 more than a multiple of 16 float2, so the 16 channels a half-warp reads back (V planes, two
// lanes) fall in distinct banks.
__host__ __device__ __forceinline__ int resident_lane_stride(int lanes) { return (lanes + 15) / 16 * 16 + 2; }

// A group (n, g) seen as `rows` rows of `row_vecs` V-wide vectors, `row_stride` elements apart.
// NCHW: its cpg channels are the rows (HW each). Channels-last: its HW pixels are (cpg each, C apart).
struct GroupView {
  int64_t rows, row_vecs, row_stride, group_vecs;
};

struct Args {
  const void* x;
  const void* weight;
  const void* bias;
  void* y;
  int64_t channels, spatial, groups, cpg;
  GroupView view;
  float eps;
  bool channels_last;
  Activation activation;
  int chunks;          // split and resident paths: chunks (blocks) per group or sample
  int64_t chunk_size;  // groups and resident-spans paths: vectors per chunk; nhwc: pixels per chunk
  int tiles;           // nhwc path: column tiles per sample
  int tile_vecs;       // nhwc path: column vectors per tile (whole groups)
  int64_t resident_rows;  // resident path: pixel rows per block (chunks = blocks per sample)
  // resident pixels: values of a group in a block, in the last block of a sample, 1 / in a sample
  float block_count, last_block_count, inv_count;
  Moments* partial;    // split paths: [N * G, chunks]
  float2* sums;        // resident spans: [N * G, chunks] shifted sums (the same workspace)
  float4* shifted;     // resident pixels: [N * G, chunks] (sums, the block's shift; the same workspace)
  float2* stats;       // split paths: [N * G] (mean, rstd)
};

__device__ __forceinline__ int64_t group_offset(const Args& a, int64_t n, int64_t g) {
  return n * a.channels * a.spatial + g * a.cpg * (a.channels_last ? 1 : a.spatial);
}

// The activation of a result stored as T: silu_as<T> (one MUFU.TANH for 16-bit types), which
// made the fused and channels-last resident kernels faster (H200, 2026-11-24, fp16: 2x640x32x32
// channels-last 9.4 -> 8.9 us, 2x960x64x64 17.3 -> 16.0) but the NCHW resident kernel slower at
// its large spans (2x960x64x64 15.9 -> 20.9, 2x320x64x64 9.2 -> 9.6; cause not found): that
// kernel, and the split ones (not measured), pass T = float, which keeps silu().
template <typename T>
__device__ __forceinline__ float activate(const Args& a, float v) {
  return a.activation == Activation::kSilu ? silu_as<T>(v) : v;
}

// weight[ch] (1 when absent) and bias[ch] (0 when absent), P being the parameters' type.
template <typename P>
__device__ __forceinline__ float2 affine_at(const Args& a, int64_t ch) {
  const float w = a.weight ? to_float(__ldg(static_cast<const P*>(a.weight) + ch)) : 1.0f;
  const float b = a.bias ? to_float(__ldg(static_cast<const P*>(a.bias) + ch)) : 0.0f;
  return make_float2(w, b);
}

// Splits a vector index of the group view into (row, column); 32-bit division when it fits.
__device__ __forceinline__ void split(const GroupView& gv, int64_t v, int64_t& row, int64_t& col) {
  if (gv.group_vecs <= 0xffffffffLL) {
    const uint32_t r = static_cast<uint32_t>(v) / static_cast<uint32_t>(gv.row_vecs);
    row = r;
    col = static_cast<uint32_t>(v) - r * static_cast<uint32_t>(gv.row_vecs);
  } else {
    row = v / gv.row_vecs;
    col = v - row * gv.row_vecs;
  }
}

// Exact moments of up to kUnroll loaded vectors (`valid` of them).
template <int V>
__device__ __forceinline__ Moments batch_moments(const float (&vals)[kUnroll][V], int valid) {
  float sum = 0.0f;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
#pragma unroll
    for (int i = 0; i < V; ++i) sum += u < valid ? vals[u][i] : 0.0f;
  const float count = static_cast<float>(valid * V);
  const float mean = sum / count;
  return {count, mean, squared_deviations(vals, mean, [&](int u) { return u < valid; })};
}

// The layout and the activation are compile-time: read at run time inside the unrolled loops they
// made the kernel 1.2-1.3x slower (H200, fp16, docs/perf/norms.md), as in bias_act and layer_norm.
template <typename T, typename P, int V, int K, bool kChannelsLast, bool kSilu>
__global__ void __launch_bounds__(kFusedThreads) group_norm_fused_kernel(Args a) {
  start_after_prior_grid();
  __shared__ float scratch[32];
  // [cpg]: scale, shift of the group's channels. Channels-last: as V planes [V][row_vecs], so
  // that a warp's lanes (consecutive columns) read consecutive entries; indexed by channel, lanes
  // V channels apart read every 16th bank (16-way conflicts at V = 8: 0.9 of 4.2 us at 2x2560x8x8,
  // H200, 2026-11-24).
  extern __shared__ float2 affine[];
  const int64_t ng = blockIdx.x, n = ng / a.groups, g = ng % a.groups;
  const int64_t offset = n * a.channels * a.spatial + g * a.cpg * (kChannelsLast ? 1 : a.spatial);
  const T* x = static_cast<const T*>(a.x) + offset;
  T* y = static_cast<T*>(a.y) + offset;
  const GroupView& gv = a.view;
  const int group_vecs = static_cast<int>(gv.group_vecs), row_vecs = static_cast<int>(gv.row_vecs);

  // Each vector's place in the group and the slot of its scale and shift: channels-last rows are
  // pixels C apart (the slot is the column), an NCHW group is contiguous (the slot is the row;
  // a vector's offset is u * V, as rows are HW apart and hold row_vecs whole vectors). Written out
  // here rather than through group_offset() and split(), whose run-time layout and 64-bit branch
  // made the NCHW forms 2-4% slower (H200, 2026-11-24 06:20 UTC, 2x2560x8x8: 3.72 -> 3.86 us).
  // Loads are unconditional, a slot past the group re-reading vector 0 (its values unused): under
  // a condition each load waited for the previous one's sum, K round trips to memory instead of
  // one (H200, 2x1280x16x16 channels-last, 4 vectors a thread: 6.3 -> 4.9 us).
  int64_t at[K];
  int slot[K];
  float vals[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int v = threadIdx.x + k * blockDim.x, u = v < group_vecs ? v : 0;
    const int row = u / row_vecs, col = u - row * row_vecs;
    at[k] = kChannelsLast ? row * gv.row_stride + col * V : static_cast<int64_t>(u) * V;
    slot[k] = kChannelsLast ? col : row;
    load_packed<T, V>(x + at[k], vals[k]);
  }
  // The first blockDim.x channels' weight and bias, fetched behind x: their latency hides behind
  // the reductions instead of following them.
  const float2 first_wb = threadIdx.x < a.cpg ? affine_at<P>(a, g * a.cpg + threadIdx.x) : float2{};
  auto in_group = [&](int k) { return static_cast<int>(threadIdx.x + k * blockDim.x) < group_vecs; };
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) sum += in_group(k) ? vals[k][i] : 0.0f;
  const float count = static_cast<float>(gv.group_vecs * V);
  const float mean = block_sum(sum, scratch) / count;
  const float m2 = squared_deviations(vals, mean, in_group);
  const float rstd = rsqrtf(block_sum(m2, scratch) / count + a.eps);
  for (int64_t c = threadIdx.x; c < a.cpg; c += blockDim.x) {
    const float2 wb = c == threadIdx.x ? first_wb : affine_at<P>(a, g * a.cpg + c);
    const int64_t at_c = kChannelsLast ? c % V * row_vecs + c / V : c;
    affine[at_c] = make_float2(rstd * wb.x, wb.y - mean * rstd * wb.x);
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (in_group(k)) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float2 ss = affine[kChannelsLast ? i * row_vecs + slot[k] : slot[k]];
        const float out = vals[k][i] * ss.x + ss.y;
        vals[k][i] = kSilu ? silu_as<T>(out) : out;
      }
      store_packed<T, V>(y + at[k], vals[k]);
    }
  }
}

// groups path, pass 1: moments of chunk (blockIdx.x % chunks) of group (blockIdx.x / chunks).
template <typename T, int V>
__global__ void __launch_bounds__(kSplitThreads) group_norm_groups_stats_kernel(Args a) {
  start_after_prior_grid();
  __shared__ Moments scratch[32];
  const int64_t ng = blockIdx.x / a.chunks, n = ng / a.groups, g = ng % a.groups;
  const int64_t begin = (blockIdx.x % a.chunks) * a.chunk_size;
  const int64_t end = std::min(begin + a.chunk_size, a.view.group_vecs);
  const T* x = static_cast<const T*>(a.x) + group_offset(a, n, g);
  const GroupView& gv = a.view;

  Moments m{0.0f, 0.0f, 0.0f};
  for (int64_t v0 = begin + threadIdx.x; v0 < end; v0 += kUnroll * blockDim.x) {
    float vals[kUnroll][V];
    int valid = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * blockDim.x;
      if (v < end) {
        int64_t row, col;
        split(gv, v, row, col);
        load_packed<T, V>(x + row * gv.row_stride + col * V, vals[u]);
        valid = u + 1;
      }
    }
    m = merge(m, batch_moments<V>(vals, valid));
  }
  m = block_merge(m, scratch);
  if (threadIdx.x == 0) a.partial[blockIdx.x] = m;
}

// Merges a group's chunk moments into (mean, rstd), by one whole warp (every lane gets it). Two
// passes with no division per chunk: the mean (relative to the first chunk's, for precision),
// then the m2 of each chunk plus its spread around that mean.
__device__ __forceinline__ float2 finalize_group(const Args& a, int64_t ng, int lane) {
  const Moments* parts = a.partial + ng * a.chunks;
  const float base = parts[0].mean;
  float count = 0.0f, offset = 0.0f;
  for (int c = lane; c < a.chunks; c += 32) {
    const Moments p = parts[c];
    count += p.count;
    offset += p.count * (p.mean - base);
  }
  count = warp_sum(count);
  const float mean = base + warp_sum(offset) / count;
  float m2 = 0.0f;
  for (int c = lane; c < a.chunks; c += 32) {
    const Moments p = parts[c];
    const float d = p.mean - mean;
    m2 += p.m2 + p.count * d * d;
  }
  return make_float2(mean, rsqrtf(warp_sum(m2) / count + a.eps));
}

// Split schemes, pass 2: one warp per group.
__global__ void __launch_bounds__(kFinalizeWarps * 32) group_norm_finalize_kernel(Args a, int64_t groups_total) {
  start_after_prior_grid();
  const int64_t ng = static_cast<int64_t>(blockIdx.x) * kFinalizeWarps + threadIdx.x / 32;
  if (ng >= groups_total) return;  // whole warps leave together
  const float2 s = finalize_group(a, ng, threadIdx.x % 32);
  if (threadIdx.x % 32 == 0) a.stats[ng] = s;
}

// groups scheme, pass 3: normalize chunk (blockIdx.x % chunks) of group (blockIdx.x / chunks).
template <typename T, typename P, int V>
__global__ void __launch_bounds__(kSplitThreads) group_norm_groups_apply_kernel(Args a) {
  start_after_prior_grid();
  const int64_t ng = blockIdx.x / a.chunks, n = ng / a.groups, g = ng % a.groups;
  const int64_t begin = (blockIdx.x % a.chunks) * a.chunk_size;
  const int64_t end = std::min(begin + a.chunk_size, a.view.group_vecs);
  const T* x = static_cast<const T*>(a.x) + group_offset(a, n, g);
  T* y = static_cast<T*>(a.y) + group_offset(a, n, g);
  const GroupView& gv = a.view;
  const float2 stats = a.stats[ng];
  const float mean = stats.x, rstd = stats.y;

  for (int64_t v0 = begin + threadIdx.x; v0 < end; v0 += kUnroll * blockDim.x) {
    float vals[kUnroll][V];
    float2 row_affine[kUnroll];  // NCHW: a vector is one channel; fetched with x
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * blockDim.x;
      if (v < end) {
        int64_t row, col;
        split(gv, v, row, col);
        load_packed<T, V>(x + row * gv.row_stride + col * V, vals[u]);
        if (!a.channels_last) row_affine[u] = affine_at<P>(a, g * a.cpg + row);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * blockDim.x;
      if (v < end) {
        int64_t row, col;
        split(gv, v, row, col);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float2 wb = a.channels_last ? affine_at<P>(a, g * a.cpg + col * V + i) : row_affine[u];
          const float scale = rstd * wb.x;
          vals[u][i] = activate<float>(a, vals[u][i] * scale + (wb.y - mean * scale));
        }
        store_packed<T, V>(y + row * gv.row_stride + col * V, vals[u]);
      }
    }
  }
}

// nhwc path: block (tile, chunk, n) covers column vectors [tile * tile_vecs, +tile_vecs) (whole
// groups) of pixels [chunk * chunk_size, +chunk_size) of sample n; threadIdx.x picks the column.
struct NhwcBlock {
  int64_t n, chunk, tile, col, pixel_begin, pixel_end, first_group;
  int groups_in_tile;
  bool active;  // this thread's column exists (the last tile may be partial)
};

// Loads the thread's channel vector at pixels p0 + u * blockDim.y (u < kUnroll) below `end`.
template <typename T, int V>
__device__ __forceinline__ void load_pixels(const T* x, int64_t channels, int64_t p0, int64_t end,
                                            float (&vals)[kUnroll][V]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t p = p0 + u * blockDim.y;
    if (p < end) load_packed<T, V>(x + p * channels, vals[u]);
  }
}

template <int V>
__device__ __forceinline__ NhwcBlock nhwc_block(const Args& a) {
  NhwcBlock b;
  b.tile = blockIdx.x % a.tiles;
  b.chunk = (blockIdx.x / a.tiles) % a.chunks;
  b.n = blockIdx.x / (static_cast<int64_t>(a.tiles) * a.chunks);
  b.col = b.tile * a.tile_vecs + threadIdx.x;
  b.pixel_begin = b.chunk * a.chunk_size;
  b.pixel_end = std::min(b.pixel_begin + a.chunk_size, a.spatial);
  const int64_t first_channel = b.tile * a.tile_vecs * V;
  b.first_group = first_channel / a.cpg;
  b.groups_in_tile = static_cast<int>(
      (std::min(first_channel + a.tile_vecs * V, a.channels) - first_channel) / a.cpg);
  b.active = b.col * V < a.channels;
  return b;
}

// nhwc scheme, pass 1. Per channel, sums of (x - shift) and its square over the block's pixels,
// the shift being the channel's value at the chunk's first pixel: sums add across threads with no
// division, and stay accurate while values sit near their shift (they are samples of the channel).
template <typename T, int V>
__global__ void __launch_bounds__(kSplitThreads) group_norm_nhwc_stats_kernel(Args a) {
  start_after_prior_grid();
  extern __shared__ float2 channel_sums[];  // [tile channels][blockDim.y | 1]; then the shifts
  const NhwcBlock b = nhwc_block<V>(a);
  const T* x = static_cast<const T*>(a.x) + b.n * a.spatial * a.channels + b.col * V;
  const int tile_channels = a.tile_vecs * V;
  float* shifts = reinterpret_cast<float*>(channel_sums + (blockDim.y | 1) * tile_channels);

  float shift[V], s1[V], s2[V];
#pragma unroll
  for (int i = 0; i < V; ++i) shift[i] = s1[i] = s2[i] = 0.0f;
  if (b.active) {
    load_packed<T, V>(x + b.pixel_begin * a.channels, shift);
    for (int64_t p0 = b.pixel_begin + threadIdx.y; p0 < b.pixel_end; p0 += kUnroll * blockDim.y) {
      float vals[kUnroll][V];
      load_pixels<T, V>(x, a.channels, p0, b.pixel_end, vals);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (p0 + u * blockDim.y < b.pixel_end) {
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const float d = vals[u][i] - shift[i];
            s1[i] += d;
            s2[i] += d * d;
          }
        }
      }
    }
  }
  // Sums of channel c (= column vector * V + i) at pixel row r sit at slot(c, r): lanes of a
  // warp hit distinct banks (an odd row stride, and i outermost), unlike a [row][channel] array.
  const int stride = static_cast<int>(blockDim.y) | 1;
  const auto slot = [&](int c, int r) { return ((c % V) * a.tile_vecs + c / V) * stride + r; };
#pragma unroll
  for (int i = 0; i < V; ++i) channel_sums[slot(threadIdx.x * V + i, threadIdx.y)] = make_float2(s1[i], s2[i]);
  if (threadIdx.y == 0) {
#pragma unroll
    for (int i = 0; i < V; ++i) shifts[threadIdx.x * V + i] = shift[i];
  }
  __syncthreads();
  // Sum over the block's pixel rows.
  int span = 1;
  while (span < static_cast<int>(blockDim.y)) span <<= 1;
  for (span >>= 1; span > 0; span >>= 1) {
    if (threadIdx.y < span && threadIdx.y + span < blockDim.y) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        float2& mine = channel_sums[slot(threadIdx.x * V + i, threadIdx.y)];
        const float2 other = channel_sums[slot(threadIdx.x * V + i, threadIdx.y + span)];
        mine = make_float2(mine.x + other.x, mine.y + other.y);
      }
    }
    __syncthreads();
  }
  // Channels into groups. All channels saw the same pixels, so the group's mean is the mean of
  // the channel means (taken relative to the first, for precision) and its m2 adds the spread.
  const float pixels = static_cast<float>(b.pixel_end - b.pixel_begin);
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  for (int gi = tid; gi < b.groups_in_tile; gi += blockDim.x * blockDim.y) {
    const int c0 = gi * static_cast<int>(a.cpg);
    const auto channel_mean = [&](int c) { return shifts[c] + channel_sums[slot(c, 0)].x / pixels; };
    const float base = channel_mean(c0);
    float offset = 0.0f;
    for (int c = c0; c < c0 + a.cpg; ++c) offset += channel_mean(c) - base;
    const float mean = base + offset / a.cpg;
    float m2 = 0.0f;
    for (int c = c0; c < c0 + a.cpg; ++c) {
      const float2 sums = channel_sums[slot(c, 0)];
      const float d = channel_mean(c) - mean;
      // Rounding can take a near-constant channel's s2 - s1^2/n just below zero.
      m2 += fmaxf(sums.y - sums.x * sums.x / pixels, 0.0f) + pixels * d * d;
    }
    const int64_t ng = b.n * a.groups + b.first_group + gi;
    a.partial[ng * a.chunks + b.chunk] = {pixels * a.cpg, mean, m2};
  }
}

template <typename T, typename P, int V>
__global__ void __launch_bounds__(kSplitThreads) group_norm_nhwc_apply_kernel(Args a) {
  start_after_prior_grid();
  const NhwcBlock b = nhwc_block<V>(a);
  if (!b.active) return;

  float scale[V], shift[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int64_t ch = b.col * V + i;
    const float2 s = a.stats[b.n * a.groups + ch / a.cpg];
    const float2 wb = affine_at<P>(a, ch);
    scale[i] = s.y * wb.x;
    shift[i] = wb.y - s.x * scale[i];
  }
  const int64_t base = b.n * a.spatial * a.channels + b.col * V;
  const T* x = static_cast<const T*>(a.x) + base;
  T* y = static_cast<T*>(a.y) + base;
  for (int64_t p0 = b.pixel_begin + threadIdx.y; p0 < b.pixel_end; p0 += kUnroll * blockDim.y) {
    float vals[kUnroll][V];
    load_pixels<T, V>(x, a.channels, p0, b.pixel_end, vals);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = p0 + u * blockDim.y;
      if (p < b.pixel_end) {
#pragma unroll
        for (int i = 0; i < V; ++i) vals[u][i] = activate<float>(a, vals[u][i] * scale[i] + shift[i]);
        store_packed<T, V>(y + p * a.channels, vals[u]);
      }
    }
  }
}

// Resident paths. Their statistics are shifted sums per group, (sum(x - k), sum((x - k)^2)), with
// a shift k near the group's mean: with one k for the block the sums of its rows and channels
// simply add, so a block reduces once and the merge after the grid barrier is a single read of
// the other blocks' sums. Measured on an H200 (docs/perf/norms.md): with exact per-block moments
// (two passes, Chan merges reading the partials twice) the reductions, not the bytes, set these
// kernels' time. The sums lose about log10(1 + (k - mean)^2 / var) digits to cancellation, so k
// is the mean of 32 values spread over the group (one value could be an outlier), taken by a
// whole warp: shift_of is their mean, which every lane gets.
//  - NCHW (spans): every block of a group takes the same 32 values from global memory
//    (shift_sample), bit for bit the same k everywhere, so the blocks' sums add too. They are
//    loaded after the block's tile has gone out: loaded before it, they delayed it by about 1 us.
//  - Channels-last (pixels): a block holds all the groups of its pixels, and 32 scattered loads
//    for each of 32 groups were more requests than the tile's own (at 2x640x32x32 they took the
//    load phase from 1.0 to 2.2 us, H200, 2026-11-24). Each block takes its 32 values from its
//    tile in shared memory instead and stores its k beside its sums; the merge combines the
//    blocks' sums about the group's mean (finalize_block_shifted).
template <typename T>
__device__ __forceinline__ float shift_sample(const Args& a, int64_t n, int64_t g, int lane) {
  const int64_t channel = lane % static_cast<int>(a.cpg), pixel = lane * a.spatial / 32;
  const int64_t at = a.channels_last ? pixel * a.channels + channel : channel * a.spatial + pixel;
  return to_float(static_cast<const T*>(a.x)[group_offset(a, n, g) + at]);
}

__device__ __forceinline__ float shift_of(float sample) { return warp_sum(sample) / 32.0f; }

// A variance from sums: rounding can take a near-constant group's s2 / n - d^2 just below zero,
// clamped here; NaN (a group holding Inf: Inf - Inf) stays NaN, as in PyTorch (fmaxf made it 0,
// and the group's outputs +-Inf).
__device__ __forceinline__ float nonnegative(float variance) { return variance < 0.0f ? 0.0f : variance; }

// (mean, rstd) of group ng from the shifted sums of its `chunks` blocks, by one whole warp (every
// lane gets it); the sums are added in a fixed order, so results do not vary between runs.
__device__ __forceinline__ float2 finalize_shifted(const Args& a, int64_t ng, float shift, float count, int lane) {
  const float2* sums = a.sums + ng * a.chunks;
  float s1 = 0.0f, s2 = 0.0f;
  // Unrolled so that a lane's loads are in flight together: one trip to L2 rather than three at
  // the 66 blocks of a sample (measured on an H200).
#pragma unroll 4
  for (int c = lane; c < a.chunks; c += 32) {
    const float2 s = sums[c];
    s1 += s.x;
    s2 += s.y;
  }
  const float d = warp_sum(s1) / count;
  const float var = nonnegative(warp_sum(s2) / count - d * d);
  return make_float2(shift + d, rsqrtf(var + a.eps));
}

// (mean, rstd) of group ng from its `chunks` blocks' shifted sums (s1, s2) about their own shifts
// k_c, by one whole warp holding each block's sums in registers (Chan's merge). The mean first,
// about chunk 0's shift: k_0 + sum(n_c (k_c - k_0) + s1_c) / N (summing n_c k_c itself could
// overflow and would lose the mean's low digits at large offsets); then the squared deviations,
// sum(s2_c + d_c (2 s1_c + n_c d_c)) with d_c = k_c - mean. Neither step cancels, however far a
// block's k_c lies from the mean (a block of outliers). Block c holds n_c = rows_c * cpg values
// (the last block may hold fewer rows); lanes past the last block add nothing; sums are added in
// a fixed order. Each block runs this for every group of its sample, a warp a group, in a phase
// bound by instruction issue: the counts come from the host, no division (with 64-bit counts and
// a division in each warp this phase took 2.3 us instead of 1.1 at 2x640x32x32, H200).
__device__ __forceinline__ float2 finalize_block_shifted(const Args& a, int64_t ng, int lane) {
  static_assert(kMaxPixelChunks % 32 == 0, "a warp's lanes hold kMaxPixelChunks / 32 blocks each");
  constexpr int kPerLane = kMaxPixelChunks / 32;
  const int chunks = a.chunks;
  const float4* partials = a.shifted + static_cast<int>(ng) * chunks;
  float4 p[kPerLane];
  float n[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int c = lane + 32 * j;
    p[j] = c < chunks ? partials[c] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    n[j] = c < chunks - 1 ? a.block_count : (c == chunks - 1 ? a.last_block_count : 0.0f);
  }
  const float k0 = __shfl_sync(0xffffffffu, p[0].z, 0);
  float total = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) total += n[j] > 0.0f ? fmaf(n[j], p[j].z - k0, p[j].x) : 0.0f;
  const float mean = k0 + warp_sum(total) * a.inv_count;
  float m2 = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const float d = p[j].z - mean;
    m2 += n[j] > 0.0f ? fmaf(d, fmaf(n[j], d, 2.0f * p[j].x), p[j].y) : 0.0f;
  }
  return make_float2(mean, rsqrtf(nonnegative(warp_sum(m2) * a.inv_count) + a.eps));
}

// resident path, channels-last. Block b of sample n = b / chunks owns pixel rows
// [(b % chunks) * resident_rows, +resident_rows) of that sample: a contiguous span of x. Threads
// are (row lane, column vector) pairs, so a thread always sees the same V channels.
// Shared memory: the tile [rows][C] in T; the threads' shifted sums [V][lane_stride] (i
// outermost, so lanes store to distinct banks; the stride's padding spreads a group's channels
// over the banks when warps read them back), whose space later holds the (scale, shift) planes;
// per channel (weight, bias) [C], then its group's shift [C] (16-byte aligned: C % V == 0).
template <typename T, typename P, int V>
__global__ void __launch_bounds__(kResidentThreads, 1) group_norm_resident_pixels_kernel(Args a) {
  start_after_prior_grid();
  static_assert(V % 4 == 0, "shifts are read as float4");
  extern __shared__ __align__(16) unsigned char resident_smem[];
  const int channels = static_cast<int>(a.channels), groups = static_cast<int>(a.groups);
  const int cpg = static_cast<int>(a.cpg), col_vecs = channels / V;
  const int row_lanes = blockDim.x / col_vecs, lanes = row_lanes * col_vecs;
  const int lane_stride = resident_lane_stride(lanes);
  const int row_lane = threadIdx.x / col_vecs, col = threadIdx.x % col_vecs;
  const bool active = threadIdx.x < lanes;
  const int64_t n = blockIdx.x / a.chunks, chunk = blockIdx.x % a.chunks;
  const int64_t first_row = chunk * a.resident_rows;
  const int rows = static_cast<int>(std::min(a.resident_rows, a.spatial - first_row));  // >= 1
  const int64_t offset = (n * a.spatial + first_row) * channels;

  T* tile = reinterpret_cast<T*>(resident_smem);
  float2* lane_sums = reinterpret_cast<float2*>(tile + a.resident_rows * channels);
  float2* affine = lane_sums + V * lane_stride;
  float* shifts = reinterpret_cast<float*>(affine + channels);

  // Global to shared memory without a stop in registers: every load of the block in flight at once.
  const T* x = static_cast<const T*>(a.x) + offset;
  for (int v = threadIdx.x; v < rows * col_vecs; v += blockDim.x)
    __pipeline_memcpy_async(tile + v * V, x + v * V, sizeof(T) * V);
  __pipeline_commit();
  for (int ch = threadIdx.x; ch < channels; ch += blockDim.x) affine[ch] = affine_at<P>(a, ch);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __pipeline_wait_prior(0);
  __syncthreads();
  // The block's shift of each group, 32 of its values over the tile's rows, stored for each of
  // the group's channels: a thread then reads its V channels' shifts as vectors (finding each
  // channel's group took ~50 instructions a thread, in a phase bound by instruction issue).
  for (int g = warp; g < groups; g += warps) {
    const float shift = shift_of(to_float(tile[lane * rows / 32 * channels + g * cpg + lane % cpg]));
    for (int c = lane; c < cpg; c += 32) shifts[g * cpg + c] = shift;
  }
  __syncthreads();

  // The thread's V channels over its rows.
  if (active) {
    float shift[V], s1[V], s2[V];
#pragma unroll
    for (int i = 0; i < V; i += 4) {
      const float4 k = *reinterpret_cast<const float4*>(shifts + col * V + i);
      shift[i] = k.x, shift[i + 1] = k.y, shift[i + 2] = k.z, shift[i + 3] = k.w;
    }
#pragma unroll
    for (int i = 0; i < V; ++i) s1[i] = s2[i] = 0.0f;
    for (int r = row_lane; r < rows; r += row_lanes) {
      float vals[V];
      load_packed<T, V>(tile + (r * col_vecs + col) * V, vals);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float d = vals[i] - shift[i];
        s1[i] += d;
        s2[i] = fmaf(d, d, s2[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < V; ++i) lane_sums[i * lane_stride + threadIdx.x] = make_float2(s1[i], s2[i]);
  }
  __syncthreads();
  // Per channel over the row lanes, a thread a channel, the total going to its row lane 0 entry;
  // then per group over its channels, a warp a group.
  for (int ch = threadIdx.x; ch < channels; ch += blockDim.x) {
    float2* sums = lane_sums + (ch % V) * lane_stride + ch / V;
    float2 total = sums[0];
#pragma unroll 4
    for (int r = 1; r < row_lanes; ++r) {
      const float2 s = sums[r * col_vecs];
      total.x += s.x;
      total.y += s.y;
    }
    sums[0] = total;
  }
  __syncthreads();
  const auto channel_sums = [&](int ch) { return lane_sums[(ch % V) * lane_stride + ch / V]; };
  for (int g = warp; g < groups; g += warps) {
    float s1 = 0.0f, s2 = 0.0f;
    for (int c = lane; c < cpg; c += 32) {
      const float2 s = channel_sums(g * cpg + c);
      s1 += s.x;
      s2 += s.y;
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    if (lane == 0) a.shifted[(n * groups + g) * a.chunks + chunk] = make_float4(s1, s2, shifts[g * cpg], 0.0f);
  }

  cooperative_groups::this_grid().sync();

  // The sample's statistics, a warp a group, straight into its channels' (scale, shift) planes
  // [V][col_vecs] (the sums' space, no longer read): a warp's reads of its columns' i-th channel
  // below are then consecutive. Read from [C], 64 bytes a thread apart, they were 16-way bank
  // conflicts (2 us at 2x320x64x64 on an H200).
  float2* scale_shift = lane_sums;
  for (int g = warp; g < groups; g += warps) {
    const float2 s = finalize_block_shifted(a, n * groups + g, lane);
    for (int ch = g * cpg + lane; ch < (g + 1) * cpg; ch += 32) {
      const float2 wb = affine[ch];
      scale_shift[(ch % V) * col_vecs + ch / V] = make_float2(s.y * wb.x, wb.y - s.x * s.y * wb.x);
    }
  }
  __syncthreads();
  if (!active) return;
  float2 ss[V];
#pragma unroll
  for (int i = 0; i < V; ++i) ss[i] = scale_shift[i * col_vecs + col];
  T* y = static_cast<T*>(a.y) + offset;
  for (int r = row_lane; r < rows; r += row_lanes) {
    float vals[V];
    load_packed<T, V>(tile + (r * col_vecs + col) * V, vals);
#pragma unroll
    for (int i = 0; i < V; ++i) vals[i] = activate<T>(a, vals[i] * ss[i].x + ss[i].y);
    store_packed<T, V>(y + (r * col_vecs + col) * V, vals);
  }
}

// resident path, NCHW: block b owns vectors [(b % chunks) * chunk_size, +chunk_size) of group
// ng = b / chunks, whose cpg channels are one contiguous span of cpg * HW elements (HW % V == 0,
// so a vector lies in one channel). Shared memory: the span's tile, then (weight, bias), later
// (scale, shift), of the group's channels [cpg].
template <typename T, typename P, int V>
__global__ void __launch_bounds__(kResidentThreads, 1) group_norm_resident_spans_kernel(Args a) {
  start_after_prior_grid();
  extern __shared__ __align__(16) unsigned char resident_smem[];
  __shared__ float2 scratch[32];
  __shared__ float2 stats;
  const int64_t ng = blockIdx.x / a.chunks, chunk = blockIdx.x % a.chunks;
  const int64_t n = ng / a.groups, g = ng % a.groups;
  const int64_t begin = chunk * a.chunk_size;
  const int vecs = static_cast<int>(std::min(a.chunk_size, a.view.group_vecs - begin));  // >= 1
  const int64_t offset = group_offset(a, n, g) + begin * V;
  T* tile = reinterpret_cast<T*>(resident_smem);
  float2* affine = reinterpret_cast<float2*>(tile + a.chunk_size * V);

  const T* x = static_cast<const T*>(a.x) + offset;
  for (int v = threadIdx.x; v < vecs; v += blockDim.x)
    __pipeline_memcpy_async(tile + v * V, x + v * V, sizeof(T) * V);
  __pipeline_commit();
  for (int c = threadIdx.x; c < a.cpg; c += blockDim.x) affine[c] = affine_at<P>(a, g * a.cpg + c);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float shift = shift_of(shift_sample<T>(a, n, g, lane));  // every warp alike: no exchange
  __pipeline_wait_prior(0);
  __syncthreads();

  float s1 = 0.0f, s2 = 0.0f;
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
    float vals[V];
    load_packed<T, V>(tile + v * V, vals);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float d = vals[i] - shift;
      s1 += d;
      s2 = fmaf(d, d, s2);
    }
  }
  const float2 sums = block_sum(make_float2(s1, s2), scratch);
  if (threadIdx.x == 0) a.sums[ng * a.chunks + chunk] = sums;

  cooperative_groups::this_grid().sync();

  if (warp == 0) {
    const float2 s = finalize_shifted(a, ng, shift, static_cast<float>(a.view.group_vecs) * V, lane);
    if (lane == 0) stats = s;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < a.cpg; c += blockDim.x) {
    const float2 wb = affine[c];
    affine[c] = make_float2(stats.y * wb.x, wb.y - stats.x * stats.y * wb.x);
  }
  __syncthreads();
  T* y = static_cast<T*>(a.y) + offset;
  // The channel of vector v, stepped along with v: a division per vector cost more than the math.
  const int spatial_vecs = static_cast<int>(a.spatial / V);
  const int channel_step = blockDim.x / spatial_vecs, column_step = blockDim.x % spatial_vecs;
  const int64_t first = begin + threadIdx.x;
  int channel = static_cast<int>(first / spatial_vecs), column = static_cast<int>(first % spatial_vecs);
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
    const float2 ss = affine[channel];
    channel += channel_step;
    column += column_step;
    if (column >= spatial_vecs) column -= spatial_vecs, ++channel;
    float vals[V];
    load_packed<T, V>(tile + v * V, vals);
#pragma unroll
    for (int i = 0; i < V; ++i) vals[i] = activate<float>(a, vals[i] * ss.x + ss.y);
    store_packed<T, V>(y + v * V, vals);
  }
}

struct Plan {
  Path path;
  int vec;         // elements per access
  int per_thread;  // fused: vectors per thread (a power of two)
  int64_t groups_total;  // N * G
  dim3 grid, block;
  size_t shared_bytes;
  Args args;
};

// Whether this device can run the resident path with `bytes` of shared memory a block.
bool resident_fits(size_t bytes) {
  int device = 0, cooperative = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device);
  return cooperative && bytes <= max_shared_bytes_per_block();
}

// Sizes the channels-last resident path: as many blocks per sample as multiprocessors allow,
// rows split evenly. False when it does not fit.
bool resident_pixels_plan(const GroupNormParams& p, Plan& plan) {
  const int sms = sm_count();
  const int elem = dtype_size(p.dtype), vec = 16 / elem;
  const int64_t col_vecs = p.channels / vec;
  if (p.batch > sms || col_vecs > kResidentThreads) return false;
  Args& a = plan.args;
  a.resident_rows = ceil_div(p.spatial, sms / p.batch);
  a.chunks = static_cast<int>(ceil_div(p.spatial, a.resident_rows));
  if (a.chunks > kMaxPixelChunks) return false;
  a.block_count = static_cast<float>(a.resident_rows * a.cpg);
  a.last_block_count = static_cast<float>((p.spatial - (a.chunks - 1) * a.resident_rows) * a.cpg);
  a.inv_count = static_cast<float>(1.0 / static_cast<double>(p.spatial * a.cpg));
  const int lanes = static_cast<int>(kResidentThreads / col_vecs * col_vecs);
  const int64_t bytes = a.resident_rows * p.channels * elem + vec * resident_lane_stride(lanes) * sizeof(float2) +
                        p.channels * (sizeof(float2) + sizeof(float));
  if (!resident_fits(static_cast<size_t>(bytes))) return false;
  plan.shared_bytes = static_cast<size_t>(bytes);
  plan.grid = dim3(static_cast<unsigned>(p.batch * a.chunks));
  plan.block = dim3(kResidentThreads);
  return true;
}

// Sizes the NCHW resident path: each group split into as many equal spans as multiprocessors
// allow. False when there are more groups than multiprocessors or a span does not fit.
bool resident_spans_plan(const GroupNormParams& p, int64_t group_vecs, Plan& plan) {
  const int sms = sm_count();
  const int64_t ng = p.batch * p.groups;
  if (ng > sms) return false;
  Args& a = plan.args;
  a.chunk_size = ceil_div(group_vecs, sms / ng);
  a.chunks = static_cast<int>(ceil_div(group_vecs, a.chunk_size));
  const int64_t bytes = a.chunk_size * 16 + p.channels / p.groups * sizeof(float2);
  // The kernel's own __shared__ variables count against the same limit as the tile: without
  // them a tile within 264 bytes of it passed here and the launch failed ("invalid argument").
  static const size_t static_bytes = [] {
    cudaFuncAttributes attributes{};  // the same for every instance: read from one
    if (cudaFuncGetAttributes(&attributes, group_norm_resident_spans_kernel<float, float, 4>) != cudaSuccess)
      cudaGetLastError();  // not fatal: the launch reports a real fault
    return attributes.sharedSizeBytes;
  }();
  if (!resident_fits(static_cast<size_t>(bytes) + static_bytes)) return false;
  plan.shared_bytes = static_cast<size_t>(bytes);
  plan.grid = dim3(static_cast<unsigned>(ng * a.chunks));
  plan.block = dim3(kResidentThreads);
  return true;
}

Plan make_plan(const GroupNormParams& p) {
  Plan plan{};
  plan.groups_total = p.batch * p.groups;
  Args& a = plan.args;
  a.x = p.x;
  a.weight = p.weight;
  a.bias = p.bias;
  a.y = p.y;
  a.channels = p.channels;
  a.spatial = p.spatial;
  a.groups = p.groups;
  a.cpg = p.channels / p.groups;
  a.eps = p.eps;
  a.channels_last = p.channels_last;
  a.activation = p.activation;

  const int elem = dtype_size(p.dtype);
  const int pack = 16 / elem;
  const bool aligned = is_aligned(p.x, 16) && is_aligned(p.y, 16);
  // Rows of the group view: NCHW rows are channels (HW long), channels-last rows are pixels.
  const int64_t rows = p.channels_last ? p.spatial : a.cpg;
  const int64_t row_len = p.channels_last ? a.cpg : p.spatial;
  const int64_t row_stride = p.channels_last ? p.channels : p.spatial;
  const int64_t ng = p.batch * p.groups;

  // nhwc path: tiles of whole groups; the vector needs only C % pack (tiles align to lcm(cpg, pack)).
  const int nhwc_vec = (aligned && p.channels % pack == 0) ? pack : 1;
  const int64_t lcm_vecs = std::lcm<int64_t>(a.cpg, nhwc_vec) / nhwc_vec;
  const int group_vec = (aligned && row_len % pack == 0 && row_stride % pack == 0) ? pack : 1;
  const int64_t group_vecs = rows * row_len / group_vec;

  // NCHW groups of a few thousand vectors: the fused kernel's one block per group leaves half of
  // the multiprocessors idle at 64 groups; the resident kernel splits each group over several.
  if (!p.channels_last && group_vec == pack && group_vecs > kSpansMinVecs && 2 * ng <= sm_count() &&
      resident_spans_plan(p, group_vecs, plan)) {
    plan.path = Path::kResidentSpans;
    plan.vec = pack;
  } else if (group_vecs <= kFusedMaxVecs && a.cpg <= kMaxFusedChannels) {
    plan.path = Path::kFused;
    plan.vec = group_vec;
    plan.per_thread = 1;
    while (plan.per_thread * kFusedThreads < group_vecs) plan.per_thread *= 2;
    const int64_t threads = ceil_div(ceil_div(group_vecs, plan.per_thread), 32) * 32;
    plan.grid = dim3(static_cast<unsigned>(ng));
    plan.block = dim3(static_cast<unsigned>(threads));
    plan.shared_bytes = static_cast<size_t>(a.cpg) * sizeof(float2);
  } else if (p.channels_last && nhwc_vec == pack && resident_pixels_plan(p, plan)) {
    plan.path = Path::kResidentPixels;
    plan.vec = pack;
  } else if (!p.channels_last && group_vec == pack && resident_spans_plan(p, group_vecs, plan)) {
    plan.path = Path::kResidentSpans;  // more groups than half the multiprocessors
    plan.vec = pack;
  } else if (p.channels_last && lcm_vecs <= kMaxTileVecs) {
    plan.path = Path::kNhwc;
    plan.vec = nhwc_vec;
    const int64_t col_vecs = p.channels / nhwc_vec;
    a.tile_vecs = static_cast<int>(std::min(col_vecs, kMaxTileVecs / lcm_vecs * lcm_vecs));
    a.tiles = static_cast<int>(ceil_div(col_vecs, a.tile_vecs));
    const int block_y = std::max(1, kSplitThreads / a.tile_vecs);
    // One unrolled batch of pixels a thread: all loads in flight at once.
    a.chunk_size = std::max<int64_t>(static_cast<int64_t>(block_y) * kUnroll, ceil_div(p.spatial, kMaxChunks));
    a.chunks = static_cast<int>(ceil_div(p.spatial, a.chunk_size));
    plan.grid = dim3(static_cast<unsigned>(p.batch * a.chunks * a.tiles));
    plan.block = dim3(a.tile_vecs, block_y);
    plan.shared_bytes = static_cast<size_t>((block_y | 1) + 1) * a.tile_vecs * nhwc_vec * sizeof(float2);
  } else {
    plan.path = Path::kGroups;
    plan.vec = group_vec;
    a.chunk_size = std::max<int64_t>(kSplitThreads * kUnroll, ceil_div(group_vecs, kMaxChunks));
    a.chunks = static_cast<int>(ceil_div(group_vecs, a.chunk_size));
    plan.grid = dim3(static_cast<unsigned>(ng * a.chunks));
    plan.block = dim3(kSplitThreads);
  }
  a.view = {rows, row_len / plan.vec, row_stride, rows * row_len / plan.vec};
  return plan;
}

cudaError_t finalize(const Plan& plan, cudaStream_t stream) {
  return launch_overlapped(group_norm_finalize_kernel,
                           dim3(static_cast<unsigned>(ceil_div(plan.groups_total, kFinalizeWarps))),
                           dim3(kFinalizeWarps * 32), 0, stream, false, plan.args, plan.groups_total);
}

// The split paths: statistics of each chunk, each group's (mean, rstd), then the normalize pass.
cudaError_t three_passes(void (*stats)(Args), void (*apply)(Args), const Plan& plan, cudaStream_t stream) {
  cudaError_t status = launch_overlapped(stats, plan.grid, plan.block, plan.shared_bytes, stream, false, plan.args);
  if (status == cudaSuccess) status = finalize(plan, stream);
  if (status == cudaSuccess) status = launch_overlapped(apply, plan.grid, plan.block, 0, stream, false, plan.args);
  return status;
}

// Launches a resident kernel: cooperative (its blocks wait for each other at a grid barrier, so
// all must be resident at once), with more than the default 48 KiB of shared memory.
cudaError_t launch_cooperative(void (*kernel)(Args), const Plan& plan, cudaStream_t stream) {
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(plan.shared_bytes));
  if (status != cudaSuccess) return status;
  return launch_overlapped(kernel, plan.grid, plan.block, plan.shared_bytes, stream, true, plan.args);
}

template <typename T, typename P, int V, bool kChannelsLast, bool kSilu>
auto fused_kernel(int per_thread) {
  static_assert(kFusedMaxPerThread == 8, "one kernel per vectors-per-thread count");
  return per_thread == 1   ? group_norm_fused_kernel<T, P, V, 1, kChannelsLast, kSilu>
         : per_thread == 2 ? group_norm_fused_kernel<T, P, V, 2, kChannelsLast, kSilu>
         : per_thread == 4 ? group_norm_fused_kernel<T, P, V, 4, kChannelsLast, kSilu>
                           : group_norm_fused_kernel<T, P, V, 8, kChannelsLast, kSilu>;
}

template <typename T, typename P, int V>
cudaError_t launch_with(const Plan& plan, cudaStream_t stream) {
  const Args& a = plan.args;
  switch (plan.path) {
    case Path::kFused: {
      const bool silu = a.activation == Activation::kSilu;
      const auto kernel = a.channels_last ? (silu ? fused_kernel<T, P, V, true, true>(plan.per_thread)
                                                  : fused_kernel<T, P, V, true, false>(plan.per_thread))
                                          : (silu ? fused_kernel<T, P, V, false, true>(plan.per_thread)
                                                  : fused_kernel<T, P, V, false, false>(plan.per_thread));
      return launch_overlapped(kernel, plan.grid, plan.block, plan.shared_bytes, stream, false, a);
    }
    case Path::kResidentPixels:
    case Path::kResidentSpans:
      if constexpr (V > 1) {  // the plan picks these paths only for full-width vectors
        return launch_cooperative(plan.path == Path::kResidentPixels ? group_norm_resident_pixels_kernel<T, P, V>
                                                                     : group_norm_resident_spans_kernel<T, P, V>,
                                  plan, stream);
      }
      break;
    case Path::kNhwc:
      return three_passes(group_norm_nhwc_stats_kernel<T, V>, group_norm_nhwc_apply_kernel<T, P, V>, plan, stream);
    case Path::kGroups:
      return three_passes(group_norm_groups_stats_kernel<T, V>, group_norm_groups_apply_kernel<T, P, V>, plan, stream);
  }
  return cudaErrorInvalidValue;
}

// Parameters come in x's dtype or in float32.
template <typename T, int V>
cudaError_t launch_with_params(const Plan& plan, DType param_dtype, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, float>) {
    return launch_with<T, float, V>(plan, stream);
  } else {
    return param_dtype == DType::kFloat32 ? launch_with<T, float, V>(plan, stream)
                                          : launch_with<T, T, V>(plan, stream);
  }
}

int64_t padded_moments(const Plan& plan) {
  const int64_t moments = plan.groups_total * plan.args.chunks;
  return moments + moments % 2;
}

}  // namespace

size_t group_norm_workspace_bytes(const GroupNormParams& params) {
  if (params.batch * params.channels * params.spatial == 0) return 0;
  const Plan plan = make_plan(params);
  if (plan.path == Path::kFused) return 0;
  if (plan.path == Path::kResidentPixels) return plan.groups_total * plan.args.chunks * sizeof(float4);
  return padded_moments(plan) * sizeof(Moments) + plan.groups_total * sizeof(float2);
}

cudaError_t launch_group_norm(const GroupNormParams& params, void* workspace, cudaStream_t stream) {
  if (params.batch * params.channels * params.spatial == 0) return cudaSuccess;
  Plan plan = make_plan(params);
  plan.args.partial = static_cast<Moments*>(workspace);
  // The (mean, rstd) array follows the moments, 8-byte aligned (Moments are 12 bytes).
  plan.args.stats = reinterpret_cast<float2*>(plan.args.partial + padded_moments(plan));
  plan.args.sums = static_cast<float2*>(workspace);
  plan.args.shifted = static_cast<float4*>(workspace);
  cudaError_t status = cudaSuccess;
  MIRAGE_DISPATCH_FLOAT(params.dtype, [&] {
    constexpr int kPack = kPackWidth<scalar_t>;
    status = plan.vec == kPack
                 ? launch_with_params<scalar_t, kPack>(plan, params.param_dtype, stream)
                 : launch_with_params<scalar_t, 1>(plan, params.param_dtype, stream);
  });
  return status;
}

}  // namespace mirage::cuda
