// Winograd F(4x4, 3x3), F(5x5, 3x3) and F(6x6, 3x3) transforms of a 3x3 stride-1 'SAME' convolution (Lavin &
// Gray, 2015).
//
// A 3x3 conv computes each m x m block of output pixels (m = 4, 5 or 6, the ops' attr `block`) from the
// (m + 2) x (m + 2) input tile around it. In Winograd's domain that takes (m + 2)^2 products per channel pair
// instead of 9 m^2 (36 for 144, 49 for 225, 64 for 324): tile d -> V = B^T d B, kernel g -> U = G g G^T, then
// M = sum over input channels of V * U ((m + 2)^2 matrix products [T, C_in] x [C_in, C_out], done by TensorFlow's
// matmul), and the output block Y = A^T M A. These kernels are the two transforms of the pixels, and the
// second one's adjoint for the kernel gradient (products of V and A dY A^T); the kernel's transform is small
// and stays in Python (mrcnn_tf2/ops/fused.py, which picks m per conv).
//
// Twin: tf.nn.conv2d(x, g, 1, 'SAME') itself (mrcnn_tf2/ops/conv.py conv2d without `fused`); the result
// differs by float rounding (Winograd's sums of larger terms: about 1e-5 of the output's scale for m = 4,
// about twice that for m = 5 and 6, whose points reach +-2 and +-1/2).
//
// Glossary: B batch, H x W image, C channels, P = (m + 2)^2 points, T = B * ceil(H / m) * ceil(W / m) tiles,
// in the order (b, tile row, tile column); tile (ty, tx) covers output rows m ty..m ty + m - 1 and the same
// columns, and reads input rows m ty - 1..m ty + m (zero outside the image: the 'SAME' padding of one pixel).
// A line is the ceil(W / m) tiles of one tile row of one image, B * ceil(H / m) lines in all. The ops take a
// band of consecutive lines (attrs first_line, lines), so that a large conv's tiles need not exist all at once:
// its output is written band by band into one buffer (MrcnnWinogradOutput makes it with the first band's blocks,
// MrcnnWinogradOutputInto adds each later band's in place).

#include <algorithm>
#include <cstring>

#if defined(__SSE__)
#include <immintrin.h>
#endif

#include "common.h"

namespace mrcnn {
namespace {

constexpr int Points(int block) { return (block + 2) * (block + 2); }

// The attr `block` (the output block's side, m), or an error naming its value.
template <typename Context>
Status GetBlock(Context* c, int* block) {
  TF_RETURN_IF_ERROR(c->GetAttr("block", block));
  if (*block < 4 || *block > 6) return InvalidArgument("block must be 4, 5 or 6 (F(m x m, 3x3)), got ", *block);
  return Status();
}

// [B, H, W, C] -> [P, T_band, C]: the shape of a transform from pixels to a band's tiles.
Status TilesShape(shape_inference::InferenceContext* c) {
  shape_inference::ShapeHandle input;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &input));
  int64_t first_line = 0, lines = 0;
  int block = 0;
  TF_RETURN_IF_ERROR(c->GetAttr("first_line", &first_line));
  TF_RETURN_IF_ERROR(c->GetAttr("lines", &lines));
  TF_RETURN_IF_ERROR(GetBlock(c, &block));
  const auto known = [&](int i) { return c->ValueKnown(c->Dim(input, i)); };
  const auto tiles_across = [&](int i) { return (c->Value(c->Dim(input, i)) + block - 1) / block; };
  shape_inference::DimensionHandle tiles = c->UnknownDim();
  if (lines >= 0 && known(2)) {
    tiles = c->MakeDim(lines * tiles_across(2));
  } else if (known(0) && known(1) && known(2)) {
    tiles = c->MakeDim((c->Value(c->Dim(input, 0)) * tiles_across(1) - first_line) * tiles_across(2));
  }
  c->set_output(0, c->MakeShape({Points(block), tiles, c->Dim(input, 3)}));
  return Status();
}

REGISTER_OP("MrcnnWinogradInput")
    .Input("input: float")              // [B, H, W, C]
    .Attr("first_line: int >= 0 = 0")   // the band's first line of tiles
    .Attr("lines: int >= -1 = -1")      // its lines; -1: to the last
    .Attr("block: int = 4")             // m: 4, 5 or 6
    .Output("tiles: float")             // [P, T_band, C]: V of the band's tiles, point-major
    .SetShapeFn(TilesShape);

// The output transform's adjoint, for the kernel gradient: the gradient dM = A dY A^T of every tile's products
// from the gradient dY of its m x m output block (zero past the image's edge).
REGISTER_OP("MrcnnWinogradOutputAdjoint")
    .Input("output_grad: float")  // [B, H, W, C]
    .Attr("first_line: int >= 0 = 0")
    .Attr("lines: int >= -1 = -1")
    .Attr("block: int = 4")
    .Output("tiles: float")       // [P, T_band, C]
    .SetShapeFn(TilesShape);

REGISTER_OP("MrcnnWinogradOutput")
    .Input("products: float")     // [P, T_band, C]: M of the band's tiles
    .Input("size: int32")         // [3]: B, H, W of the output
    .Input("bias: num_bias * float")  // none or one [C], added to each block's pixels
    .Attr("first_line: int >= 0 = 0")
    .Attr("num_bias: int >= 0 = 0")
    .Attr("relu: bool = false")   // each block's pixels as max(pixel, 0), after the bias
    .Attr("block: int = 4")
    .Output("output: float")      // [B, H, W, C]: the band's blocks, zeros outside the band
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle products, size;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &products));
      TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(1, &size));
      TF_RETURN_IF_ERROR(c->WithRank(size, 3, &size));
      shape_inference::ShapeHandle output;
      TF_RETURN_IF_ERROR(c->Concatenate(size, c->Vector(c->Dim(products, 2)), &output));
      c->set_output(0, output);
      return Status();
    });

REGISTER_OP("MrcnnWinogradOutputInto")
    .Input("base: float")      // [B, H, W, C]: the output with its earlier bands
    .Input("products: float")  // [P, T_band, C]: M of the band's tiles
    .Input("bias: num_bias * float")  // as MrcnnWinogradOutput's, for this band's blocks
    .Attr("first_line: int >= 0")
    .Attr("num_bias: int >= 0 = 0")
    .Attr("relu: bool = false")
    .Attr("block: int = 4")
    .Output("output: float")   // [B, H, W, C]: base with the band's blocks written (in base's buffer if free)
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle base, products;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &base));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 3, &products));
      shape_inference::DimensionHandle channels;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(base, 3), c->Dim(products, 2), &channels));
      TF_RETURN_IF_ERROR(c->ReplaceDim(base, 3, channels, &base));
      c->set_output(0, base);
      return Status();
    });

// The kernels below are compiled for AVX-512 and AVX2 too, picked when the library loads (target_clones): the
// library stays portable, and the build has no fused multiply-adds (-ffp-contract=off), so every clone rounds
// alike. The transforms' inputs and outputs exceed the caches and another op reads the result, so the kernels
// write with stores that bypass the caches: a plain store first reads the line it overwrites, and the P point
// planes, T * C floats apart (a multiple of 4 KiB for most sizes), evict each other from the same cache sets.
// Both halved the input transform's time at P2's size; the output transform gained a third.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MRCNN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MRCNN_CLONES
#endif
#define MRCNN_INLINE inline __attribute__((always_inline))

// Copies n floats to dst; streaming: past the caches (n a multiple of 4, src and dst 16-byte aligned).
MRCNN_INLINE void Store(const float* src, float* dst, int n, bool streaming) {
#if defined(__SSE__)
  if (streaming) {
    for (int k = 0; k < n; k += 4) _mm_stream_ps(dst + k, _mm_load_ps(src + k));
    return;
  }
#endif
  std::memcpy(dst, src, n * sizeof(float));
}

// Whether a kernel can stream into `output` with rows of `channels` floats (Store's alignment).
bool CanStream(const float* output, int64_t channels) {
#if defined(__SSE__)
  return channels % 4 == 0 && reinterpret_cast<uintptr_t>(output) % 16 == 0;
#else
  return false;
#endif
}

// Makes a thread's streamed stores visible before the op's output is read.
MRCNN_INLINE void EndStreaming(bool streaming) {
#if defined(__SSE__)
  if (streaming) _mm_sfence();
#endif
}

// The 1-D transforms, each written out over n channels (restrict lets the compiler vectorize over them):
// r_i = sum_j R[i][j] x_j for the vectors x_j = x + j * x_step and r_i = r + i * r_step. Input: R = B^T
// (m + 2 in and out); Output: R = A^T (m + 2 in, m out); Adjoint: R = A (m in, m + 2 out): A dY A^T is the
// gradient of the products M of a block whose output Y = A^T M A has the gradient dY.

// F(4x4, 3x3): the points 0, +-1, +-2 and infinity.
MRCNN_INLINE void InputRows4(const float* __restrict__ x, int64_t x_step, float* __restrict__ r, int64_t r_step,
                             int n) {
  for (int k = 0; k < n; ++k) {
    const float x0 = x[k], x1 = x[x_step + k], x2 = x[2 * x_step + k], x3 = x[3 * x_step + k],
                x4 = x[4 * x_step + k], x5 = x[5 * x_step + k];
    r[k] = 4.0f * x0 - 5.0f * x2 + x4;
    r[r_step + k] = x3 + x4 - 4.0f * (x1 + x2);
    r[2 * r_step + k] = x4 - x3 + 4.0f * (x1 - x2);
    r[3 * r_step + k] = x4 - x2 + 2.0f * (x3 - x1);
    r[4 * r_step + k] = x4 - x2 - 2.0f * (x3 - x1);
    r[5 * r_step + k] = 4.0f * x1 - 5.0f * x3 + x5;
  }
}

MRCNN_INLINE void AdjointRows4(const float* __restrict__ x, int64_t x_step, float* __restrict__ r, int64_t r_step,
                               int n) {
  for (int k = 0; k < n; ++k) {
    const float x0 = x[k], x1 = x[x_step + k], x2 = x[2 * x_step + k], x3 = x[3 * x_step + k];
    const float sum02 = x0 + x2, sum13 = x1 + x3, even = x0 + 4.0f * x2, odd = 2.0f * x1 + 8.0f * x3;
    r[k] = x0;
    r[r_step + k] = sum02 + sum13;
    r[2 * r_step + k] = sum02 - sum13;
    r[3 * r_step + k] = even + odd;
    r[4 * r_step + k] = even - odd;
    r[5 * r_step + k] = x3;
  }
}

MRCNN_INLINE void OutputRows4(const float* __restrict__ x, int64_t x_step, float* __restrict__ r, int64_t r_step,
                              int n) {
  for (int k = 0; k < n; ++k) {
    const float x0 = x[k], x1 = x[x_step + k], x2 = x[2 * x_step + k], x3 = x[3 * x_step + k],
                x4 = x[4 * x_step + k], x5 = x[5 * x_step + k];
    const float sum12 = x1 + x2, diff12 = x1 - x2, sum34 = x3 + x4, diff34 = x3 - x4;
    r[k] = x0 + sum12 + sum34;
    r[r_step + k] = diff12 + 2.0f * diff34;
    r[2 * r_step + k] = sum12 + 4.0f * sum34;
    r[3 * r_step + k] = diff12 + 8.0f * diff34 + x5;
  }
}

// F(5x5, 3x3): the points +-1, +-2, +-1/2 and infinity, F(6x6, 3x3)'s without 0, so that every point has its
// pair.
MRCNN_INLINE void InputRows5(const float* __restrict__ x, int64_t x_step, float* __restrict__ r, int64_t r_step,
                             int n) {
  for (int k = 0; k < n; ++k) {
    const float x0 = x[k], x1 = x[x_step + k], x2 = x[2 * x_step + k], x3 = x[3 * x_step + k],
                x4 = x[4 * x_step + k], x5 = x[5 * x_step + k], x6 = x[6 * x_step + k];
    const float odd1 = x1 + x5 - 4.25f * x3, even1 = x0 + x4 - 4.25f * x2;
    const float odd2 = 0.25f * x1 - 1.25f * x3 + x5, even2 = 0.5f * x0 - 2.5f * x2 + 2.0f * x4;
    const float odd3 = 4.0f * x1 - 5.0f * x3 + x5, even3 = 2.0f * x0 - 2.5f * x2 + 0.5f * x4;
    r[k] = odd1 + even1;
    r[r_step + k] = odd1 - even1;
    r[2 * r_step + k] = odd2 + even2;
    r[3 * r_step + k] = odd2 - even2;
    r[4 * r_step + k] = odd3 + even3;
    r[5 * r_step + k] = odd3 - even3;
    r[6 * r_step + k] = x6 - x0 + 5.25f * (x2 - x4);
  }
}

MRCNN_INLINE void AdjointRows5(const float* __restrict__ x, int64_t x_step, float* __restrict__ r, int64_t r_step,
                               int n) {
  for (int k = 0; k < n; ++k) {
    const float x0 = x[k], x1 = x[x_step + k], x2 = x[2 * x_step + k], x3 = x[3 * x_step + k],
                x4 = x[4 * x_step + k];
    const float even1 = x0 + x2 + x4, odd1 = x1 + x3;
    const float even2 = x0 + 4.0f * x2 + 16.0f * x4, odd2 = 2.0f * x1 + 8.0f * x3;
    const float even3 = x0 + 0.25f * x2 + 0.0625f * x4, odd3 = 0.5f * x1 + 0.125f * x3;
    r[k] = even1 + odd1;
    r[r_step + k] = even1 - odd1;
    r[2 * r_step + k] = even2 + odd2;
    r[3 * r_step + k] = even2 - odd2;
    r[4 * r_step + k] = even3 + odd3;
    r[5 * r_step + k] = even3 - odd3;
    r[6 * r_step + k] = x4;
  }
}

MRCNN_INLINE void OutputRows5(const float* __restrict__ x, int64_t x_step, float* __restrict__ r, int64_t r_step,
                              int n) {
  for (int k = 0; k < n; ++k) {
    const float x0 = x[k], x1 = x[x_step + k], x2 = x[2 * x_step + k], x3 = x[3 * x_step + k],
                x4 = x[4 * x_step + k], x5 = x[5 * x_step + k], x6 = x[6 * x_step + k];
    const float sum01 = x0 + x1, diff01 = x0 - x1, sum23 = x2 + x3, diff23 = x2 - x3, sum45 = x4 + x5,
                diff45 = x4 - x5;
    r[k] = sum01 + sum23 + sum45;
    r[r_step + k] = diff01 + 2.0f * diff23 + 0.5f * diff45;
    r[2 * r_step + k] = sum01 + 4.0f * sum23 + 0.25f * sum45;
    r[3 * r_step + k] = diff01 + 8.0f * diff23 + 0.125f * diff45;
    r[4 * r_step + k] = sum01 + 16.0f * sum23 + 0.0625f * sum45 + x6;
  }
}

// F(6x6, 3x3): the points 0, +-1, +-2, +-1/2 and infinity (the pairs +-p share their even and odd parts).
MRCNN_INLINE void InputRows6(const float* __restrict__ x, int64_t x_step, float* __restrict__ r, int64_t r_step,
                             int n) {
  for (int k = 0; k < n; ++k) {
    const float x0 = x[k], x1 = x[x_step + k], x2 = x[2 * x_step + k], x3 = x[3 * x_step + k],
                x4 = x[4 * x_step + k], x5 = x[5 * x_step + k], x6 = x[6 * x_step + k], x7 = x[7 * x_step + k];
    const float even1 = x2 + x6 - 4.25f * x4, odd1 = x1 + x5 - 4.25f * x3;
    const float even2 = 0.25f * x2 - 1.25f * x4 + x6, odd2 = 0.5f * x1 - 2.5f * x3 + 2.0f * x5;
    const float even3 = 4.0f * x2 - 5.0f * x4 + x6, odd3 = 2.0f * x1 - 2.5f * x3 + 0.5f * x5;
    r[k] = x0 - x6 + 5.25f * (x4 - x2);
    r[r_step + k] = even1 + odd1;
    r[2 * r_step + k] = even1 - odd1;
    r[3 * r_step + k] = even2 + odd2;
    r[4 * r_step + k] = even2 - odd2;
    r[5 * r_step + k] = even3 + odd3;
    r[6 * r_step + k] = even3 - odd3;
    r[7 * r_step + k] = x7 - x1 + 5.25f * (x3 - x5);
  }
}

MRCNN_INLINE void AdjointRows6(const float* __restrict__ x, int64_t x_step, float* __restrict__ r, int64_t r_step,
                               int n) {
  for (int k = 0; k < n; ++k) {
    const float x0 = x[k], x1 = x[x_step + k], x2 = x[2 * x_step + k], x3 = x[3 * x_step + k],
                x4 = x[4 * x_step + k], x5 = x[5 * x_step + k];
    const float even1 = x0 + x2 + x4, odd1 = x1 + x3 + x5;
    const float even2 = x0 + 4.0f * x2 + 16.0f * x4, odd2 = 2.0f * x1 + 8.0f * x3 + 32.0f * x5;
    const float even3 = x0 + 0.25f * x2 + 0.0625f * x4, odd3 = 0.5f * x1 + 0.125f * x3 + 0.03125f * x5;
    r[k] = x0;
    r[r_step + k] = even1 + odd1;
    r[2 * r_step + k] = even1 - odd1;
    r[3 * r_step + k] = even2 + odd2;
    r[4 * r_step + k] = even2 - odd2;
    r[5 * r_step + k] = even3 + odd3;
    r[6 * r_step + k] = even3 - odd3;
    r[7 * r_step + k] = x5;
  }
}

MRCNN_INLINE void OutputRows6(const float* __restrict__ x, int64_t x_step, float* __restrict__ r, int64_t r_step,
                              int n) {
  for (int k = 0; k < n; ++k) {
    const float x0 = x[k], x1 = x[x_step + k], x2 = x[2 * x_step + k], x3 = x[3 * x_step + k],
                x4 = x[4 * x_step + k], x5 = x[5 * x_step + k], x6 = x[6 * x_step + k], x7 = x[7 * x_step + k];
    const float sum12 = x1 + x2, diff12 = x1 - x2, sum34 = x3 + x4, diff34 = x3 - x4, sum56 = x5 + x6,
                diff56 = x5 - x6;
    r[k] = x0 + sum12 + sum34 + sum56;
    r[r_step + k] = diff12 + 2.0f * diff34 + 0.5f * diff56;
    r[2 * r_step + k] = sum12 + 4.0f * sum34 + 0.25f * sum56;
    r[3 * r_step + k] = diff12 + 8.0f * diff34 + 0.125f * diff56;
    r[4 * r_step + k] = sum12 + 16.0f * sum34 + 0.0625f * sum56;
    r[5 * r_step + k] = diff12 + 32.0f * diff34 + 0.03125f * diff56 + x7;
  }
}

// An image's grid of m x m blocks, and the band of them an op computes: tiles [first, first + count) of the
// batch's.
struct Grid {
  int64_t batch, height, width, tile_rows, tile_cols, first, count;
  int64_t lines() const { return batch * tile_rows; }
};

Grid MakeGrid(int64_t batch, int64_t height, int64_t width, int block) {
  const int64_t tile_rows = (height + block - 1) / block, tile_cols = (width + block - 1) / block;
  return {batch, height, width, tile_rows, tile_cols, 0, batch * tile_rows * tile_cols};
}

// The band of `lines` lines from `first_line` (-1: to the last), or an error naming the op's input.
Status SetBand(Grid* grid, int64_t first_line, int64_t lines) {
  if (lines < 0) lines = grid->lines() - first_line;
  if (first_line + lines > grid->lines() || lines < 0) {
    return InvalidArgument("band of ", lines, " lines from line ", first_line, " is past the ", grid->lines(),
                           " lines of tiles of a ", grid->batch, "x", grid->height, "x", grid->width, " input");
  }
  grid->first = first_line * grid->tile_cols;
  grid->count = lines * grid->tile_cols;
  return Status();
}

using Rows = void (*)(const float*, int64_t, float*, int64_t, int);

// Channels transformed together: a tile's two buffers stay in L1 (2 x 9, 12 and 16 KiB for m = 4, 5 and 6;
// 32 channels for m = 6 made its transforms 20-40% slower at P2's and P3's sizes).
constexpr int kChannelBlock = 64;

// The band's tiles t in [begin, end) of `pixels` [B, H, W, C] into `tiles` [P, T_band, C] (tile grid.first + t
// of the batch at row t): each tile's side x side pixels from row m ty - margin and column m tx - margin (zero
// outside the image), transformed by kRows ((m + 2) x side) down its columns and along its rows.
template <int kBlock, int kSide, int kMargin, Rows kRows>
MRCNN_INLINE void PixelsToTiles(const Grid& grid, int64_t channels, const float* pixels, float* tiles,
                                bool streaming, int64_t begin, int64_t end) {
  constexpr int kTile = kBlock + 2, kPoints = Points(kBlock);
  const int64_t point_stride = grid.count * channels;  // from one point's [T_band, C] to the next
  alignas(64) float d[kPoints][kChannelBlock];  // the tile's pixels, then its transform
  alignas(64) float rows[kTile * kSide][kChannelBlock];  // the transform of its columns
  for (int64_t t = begin; t < end; ++t) {
    const int64_t g = grid.first + t;
    const int64_t b = g / (grid.tile_rows * grid.tile_cols);
    const int64_t y0 = (g / grid.tile_cols) % grid.tile_rows * kBlock - kMargin;
    const int64_t x0 = g % grid.tile_cols * kBlock - kMargin;
    for (int64_t c0 = 0; c0 < channels; c0 += kChannelBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kChannelBlock, channels - c0));
      for (int i = 0; i < kSide; ++i) {
        const int64_t y = y0 + i;
        for (int j = 0; j < kSide; ++j) {
          const int64_t x = x0 + j;
          if (y < 0 || y >= grid.height || x < 0 || x >= grid.width) {
            std::fill_n(d[i * kSide + j], n, 0.0f);
          } else {
            std::memcpy(d[i * kSide + j], pixels + ((b * grid.height + y) * grid.width + x) * channels + c0,
                        n * sizeof(float));
          }
        }
      }
      // Down each column, rows[xi][j] = sum_i R[xi][i] d[i][j]; then along each row,
      // V[xi][nu] = sum_j rows[xi][j] R[nu][j].
      for (int j = 0; j < kSide; ++j) {
        kRows(d[j], kSide * kChannelBlock, rows[j], kSide * kChannelBlock, n);
      }
      for (int xi = 0; xi < kTile; ++xi) {
        kRows(rows[xi * kSide], kChannelBlock, d[xi * kTile], kChannelBlock, n);
      }
      for (int p = 0; p < kPoints; ++p) {
        Store(d[p], tiles + p * point_stride + t * channels + c0, n, streaming);
      }
    }
  }
  EndStreaming(streaming);
}

// A^T M A of the band's tiles' products M (rows t in [begin, end)), into the output's m x m blocks (cut at the
// image's edge). bias (C floats or null) and relu: the conv's epilogue, applied to each block before it is
// stored.
template <int kBlock, Rows kRows>
MRCNN_INLINE void ProductsToBlocks(const Grid& grid, int64_t channels, const float* products, const float* bias,
                                   bool relu, float* output, bool streaming, int64_t begin, int64_t end) {
  constexpr int kTile = kBlock + 2;
  const int64_t point_stride = grid.count * channels;
  alignas(64) float rows[kBlock * kTile][kChannelBlock];   // A^T M: [m][m + 2]
  alignas(64) float block[kBlock * kBlock][kChannelBlock];  // A^T M A: [m][m]
  for (int64_t t = begin; t < end; ++t) {
    const int64_t g = grid.first + t;
    const int64_t b = g / (grid.tile_rows * grid.tile_cols);
    const int64_t y0 = (g / grid.tile_cols) % grid.tile_rows * kBlock;
    const int64_t x0 = g % grid.tile_cols * kBlock;
    for (int64_t c0 = 0; c0 < channels; c0 += kChannelBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kChannelBlock, channels - c0));
      // Down each column, rows[i][nu] = sum_xi A^T[i][xi] M[xi][nu]; then along each row,
      // Y[i][j] = sum_nu rows[i][nu] A^T[j][nu].
      for (int nu = 0; nu < kTile; ++nu) {
        kRows(products + nu * point_stride + t * channels + c0, kTile * point_stride, rows[nu], kTile * kChannelBlock,
              n);
      }
      for (int i = 0; i < kBlock; ++i) {
        kRows(rows[i * kTile], kChannelBlock, block[i * kBlock], kChannelBlock, n);
      }
      for (int k = 0; bias != nullptr && k < kBlock * kBlock; ++k) {
        for (int c = 0; c < n; ++c) block[k][c] += bias[c0 + c];
      }
      for (int k = 0; relu && k < kBlock * kBlock; ++k) {
        for (int c = 0; c < n; ++c) block[k][c] = std::max(block[k][c], 0.0f);
      }
      for (int i = 0; i < kBlock && y0 + i < grid.height; ++i) {
        for (int j = 0; j < kBlock && x0 + j < grid.width; ++j) {
          Store(block[i * kBlock + j], output + ((b * grid.height + y0 + i) * grid.width + x0 + j) * channels + c0,
                n, streaming);
        }
      }
    }
  }
  EndStreaming(streaming);
}

// The compiled kernels (target_clones applies to plain functions, not to templates): B^T d B of every input
// tile d, A dY A^T of every output block dY, A^T M A of every tile's products M.
MRCNN_CLONES void InputTiles4(const Grid& grid, int64_t channels, const float* pixels, float* tiles, bool streaming,
                              int64_t begin, int64_t end) {
  PixelsToTiles<4, 6, 1, InputRows4>(grid, channels, pixels, tiles, streaming, begin, end);
}
MRCNN_CLONES void InputTiles5(const Grid& grid, int64_t channels, const float* pixels, float* tiles, bool streaming,
                              int64_t begin, int64_t end) {
  PixelsToTiles<5, 7, 1, InputRows5>(grid, channels, pixels, tiles, streaming, begin, end);
}
MRCNN_CLONES void InputTiles6(const Grid& grid, int64_t channels, const float* pixels, float* tiles, bool streaming,
                              int64_t begin, int64_t end) {
  PixelsToTiles<6, 8, 1, InputRows6>(grid, channels, pixels, tiles, streaming, begin, end);
}
MRCNN_CLONES void AdjointTiles4(const Grid& grid, int64_t channels, const float* pixels, float* tiles,
                                bool streaming, int64_t begin, int64_t end) {
  PixelsToTiles<4, 4, 0, AdjointRows4>(grid, channels, pixels, tiles, streaming, begin, end);
}
MRCNN_CLONES void AdjointTiles5(const Grid& grid, int64_t channels, const float* pixels, float* tiles,
                                bool streaming, int64_t begin, int64_t end) {
  PixelsToTiles<5, 5, 0, AdjointRows5>(grid, channels, pixels, tiles, streaming, begin, end);
}
MRCNN_CLONES void AdjointTiles6(const Grid& grid, int64_t channels, const float* pixels, float* tiles,
                                bool streaming, int64_t begin, int64_t end) {
  PixelsToTiles<6, 6, 0, AdjointRows6>(grid, channels, pixels, tiles, streaming, begin, end);
}
MRCNN_CLONES void OutputBlocks4(const Grid& grid, int64_t channels, const float* products, const float* bias,
                                bool relu, float* output, bool streaming, int64_t begin, int64_t end) {
  ProductsToBlocks<4, OutputRows4>(grid, channels, products, bias, relu, output, streaming, begin, end);
}
MRCNN_CLONES void OutputBlocks5(const Grid& grid, int64_t channels, const float* products, const float* bias,
                                bool relu, float* output, bool streaming, int64_t begin, int64_t end) {
  ProductsToBlocks<5, OutputRows5>(grid, channels, products, bias, relu, output, streaming, begin, end);
}
MRCNN_CLONES void OutputBlocks6(const Grid& grid, int64_t channels, const float* products, const float* bias,
                                bool relu, float* output, bool streaming, int64_t begin, int64_t end) {
  ProductsToBlocks<6, OutputRows6>(grid, channels, products, bias, relu, output, streaming, begin, end);
}

// The kernel of a block size (GetBlock has checked it).
template <typename Kernel>
Kernel ByBlock(int block, Kernel kernel4, Kernel kernel5, Kernel kernel6) {
  return block == 4 ? kernel4 : block == 5 ? kernel5 : kernel6;
}

// MrcnnWinogradInput and MrcnnWinogradOutputAdjoint: [B, H, W, C] -> [P, T, C] by the transform of each block
// size.
class PixelsToTilesOp : public OpKernel {
 public:
  using Transform = void (*)(const Grid&, int64_t, const float*, float*, bool, int64_t, int64_t);

  PixelsToTilesOp(OpKernelConstruction* context, Transform transform4, Transform transform5, Transform transform6)
      : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("first_line", &first_line_));
    OP_REQUIRES_OK(context, context->GetAttr("lines", &lines_));
    OP_REQUIRES_OK(context, GetBlock(context, &block_));
    transform_ = ByBlock(block_, transform4, transform5, transform6);
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& input = context->input(0);
    OP_REQUIRES(context, input.dims() == 4,
                InvalidArgument("input must be [B, H, W, C], got ", input.shape().DebugString()));
    Grid grid = MakeGrid(input.dim_size(0), input.dim_size(1), input.dim_size(2), block_);
    OP_REQUIRES_OK(context, SetBand(&grid, first_line_, lines_));
    const int64_t channels = input.dim_size(3);
    Tensor* tiles_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({Points(block_), grid.count, channels}),
                                                     &tiles_tensor));
    const float* pixels = input.flat<float>().data();
    float* tiles = tiles_tensor->flat<float>().data();
    const bool streaming = CanStream(tiles, channels);
    ParallelFor(context, grid.count, Points(block_) * channels * 12, [&](int64_t begin, int64_t end) {
      transform_(grid, channels, pixels, tiles, streaming, begin, end);
    });
  }

 private:
  Transform transform_ = nullptr;
  int64_t first_line_, lines_;
  int block_ = 4;
};

class WinogradInputOp : public PixelsToTilesOp {
 public:
  explicit WinogradInputOp(OpKernelConstruction* context)
      : PixelsToTilesOp(context, InputTiles4, InputTiles5, InputTiles6) {}
};

class WinogradOutputAdjointOp : public PixelsToTilesOp {
 public:
  explicit WinogradOutputAdjointOp(OpKernelConstruction* context)
      : PixelsToTilesOp(context, AdjointTiles4, AdjointTiles5, AdjointTiles6) {}
};

// MrcnnWinogradOutput (into_ false: inputs products, size) and MrcnnWinogradOutputInto (into_ true: inputs base,
// products): the band's blocks into a new output of zeros, or into base.
class BandOutputOp : public OpKernel {
 public:
  BandOutputOp(OpKernelConstruction* context, bool into) : OpKernel(context), into_(into) {
    OP_REQUIRES_OK(context, context->GetAttr("first_line", &first_line_));
    OP_REQUIRES_OK(context, context->GetAttr("relu", &relu_));
    int num_bias = 0;
    OP_REQUIRES_OK(context, context->GetAttr("num_bias", &num_bias));
    OP_REQUIRES(context, num_bias <= 1, InvalidArgument("at most one bias, got ", num_bias));
    OP_REQUIRES_OK(context, GetBlock(context, &block_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& products_tensor = context->input(into_ ? 1 : 0);
    OP_REQUIRES(context, products_tensor.dims() == 3 && products_tensor.dim_size(0) == Points(block_),
                InvalidArgument("products must be [", Points(block_), ", T, C] for blocks of ", block_, "x", block_,
                                ", got ", products_tensor.shape().DebugString()));
    TensorShape shape;
    if (into_) {
      const Tensor& base = context->input(0);
      OP_REQUIRES(context, base.dims() == 4,
                  InvalidArgument("base must be [B, H, W, C], got ", base.shape().DebugString()));
      shape = base.shape();
    } else {
      const Tensor& size = context->input(1);
      OP_REQUIRES(context, size.dims() == 1 && size.dim_size(0) == 3,
                  InvalidArgument("size must be [3] (B, H, W), got ", size.shape().DebugString()));
      const auto dims = size.vec<int32_t>();
      OP_REQUIRES(context, dims(0) >= 0 && dims(1) >= 0 && dims(2) >= 0,
                  InvalidArgument("size must be >= 0, got ", dims(0), "x", dims(1), "x", dims(2)));
      shape = TensorShape({dims(0), dims(1), dims(2), products_tensor.dim_size(2)});
    }
    OP_REQUIRES(context, products_tensor.dim_size(2) == shape.dim_size(3),
                InvalidArgument("products ", products_tensor.shape().DebugString(),
                                " do not have the channels of the output ", shape.DebugString()));
    Grid grid = MakeGrid(shape.dim_size(0), shape.dim_size(1), shape.dim_size(2), block_);
    const int64_t tiles = products_tensor.dim_size(1);
    OP_REQUIRES(context, grid.tile_cols > 0 ? tiles % grid.tile_cols == 0 : tiles == 0,
                InvalidArgument("products hold ", tiles, " tiles, not whole lines of the ", grid.tile_cols,
                                " tiles across an output of ", shape.DebugString()));
    OP_REQUIRES_OK(context, SetBand(&grid, first_line_, grid.tile_cols > 0 ? tiles / grid.tile_cols : 0));
    Tensor* output_tensor = nullptr;
    if (into_) {
      // The earlier bands' blocks are base's: written in place when base's buffer is this op's alone (the
      // previous band's output), else copied first.
      const Tensor& base = context->input(0);
      OP_REQUIRES_OK(context, context->forward_input_or_allocate_output({0}, 0, shape, &output_tensor));
      if (output_tensor->flat<float>().data() != base.flat<float>().data()) {
        std::memcpy(output_tensor->flat<float>().data(), base.flat<float>().data(),
                    base.NumElements() * sizeof(float));
      }
    } else {
      OP_REQUIRES_OK(context, context->allocate_output(0, shape, &output_tensor));
      if (grid.count < grid.lines() * grid.tile_cols) {  // a band of the whole: the rest are zeros, not garbage
        std::fill_n(output_tensor->flat<float>().data(), output_tensor->NumElements(), 0.0f);
      }
    }
    OpInputList biases;
    OP_REQUIRES_OK(context, context->input_list("bias", &biases));
    const float* bias = nullptr;
    if (biases.size() == 1) {
      OP_REQUIRES(context, biases[0].dims() == 1 && biases[0].dim_size(0) == shape.dim_size(3),
                  InvalidArgument("bias must be [C] for an output of ", shape.DebugString(), ", got ",
                                  biases[0].shape().DebugString()));
      bias = biases[0].flat<float>().data();
    }
    float* output = output_tensor->flat<float>().data();
    const float* products = products_tensor.flat<float>().data();
    const int64_t channels = shape.dim_size(3);
    const bool streaming = CanStream(output, channels);
    const auto blocks = ByBlock(block_, OutputBlocks4, OutputBlocks5, OutputBlocks6);
    ParallelFor(context, grid.count, Points(block_) * channels * 8, [&](int64_t begin, int64_t end) {
      blocks(grid, channels, products, bias, relu_, output, streaming, begin, end);
    });
  }

 private:
  const bool into_;
  int64_t first_line_;
  bool relu_ = false;
  int block_ = 4;
};

class WinogradOutputOp : public BandOutputOp {
 public:
  explicit WinogradOutputOp(OpKernelConstruction* context) : BandOutputOp(context, false) {}
};

class WinogradOutputIntoOp : public BandOutputOp {
 public:
  explicit WinogradOutputIntoOp(OpKernelConstruction* context) : BandOutputOp(context, true) {}
};

REGISTER_KERNEL_BUILDER(Name("MrcnnWinogradInput").Device(tensorflow::DEVICE_CPU), WinogradInputOp);
REGISTER_KERNEL_BUILDER(Name("MrcnnWinogradOutput").Device(tensorflow::DEVICE_CPU), WinogradOutputOp);
REGISTER_KERNEL_BUILDER(Name("MrcnnWinogradOutputInto").Device(tensorflow::DEVICE_CPU), WinogradOutputIntoOp);
REGISTER_KERNEL_BUILDER(Name("MrcnnWinogradOutputAdjoint").Device(tensorflow::DEVICE_CPU),
                        WinogradOutputAdjointOp);

}  // namespace
}  // namespace mrcnn
