// Winograd F(4x4, 3x3) transforms of a 3x3 stride-1 'SAME' convolution (Lavin & Gray, 2015).
//
// A 3x3 conv computes each 4x4 block of output pixels from the 6x6 input tile around it. In Winograd's
// domain that takes 36 products per channel pair instead of 144: tile d -> V = B^T d B, kernel g ->
// U = G g G^T, then M = sum over input channels of V * U (36 matrix products [T, C_in] x [C_in, C_out],
// done by TensorFlow's matmul), and the output block Y = A^T M A. These kernels are the two transforms
// of the pixels, and the second one's adjoint for the kernel gradient (products of V and A dY A^T); the
// kernel's transform is small and stays in Python (mrcnn_tf2/ops/fused.py).
//
// Twin: tf.nn.conv2d(x, g, 1, 'SAME') itself (mrcnn_tf2/ops/conv.py conv2d without `fused`); the result
// differs by float rounding (Winograd's sums of larger terms: about 1e-5 of the output's scale).
//
// Glossary: B batch, H x W image, C channels, T = B * ceil(H / 4) * ceil(W / 4) tiles, in the order
// (b, tile row, tile column); tile (ty, tx) covers output rows 4ty..4ty+3 and columns 4tx..4tx+3, and
// reads input rows 4ty-1..4ty+4 (zero outside the image: the 'SAME' padding of one pixel).

#include <algorithm>
#include <cstring>

#if defined(__SSE__)
#include <immintrin.h>
#endif

#include "common.h"

namespace mrcnn {
namespace {

constexpr int kTile = 6;             // input tile side
constexpr int kBlock = 4;            // output block side
constexpr int kPoints = kTile * kTile;
constexpr int kChannelBlock = 64;    // channels transformed together: the tile's buffers stay in L1

// [B, H, W, C] -> [36, T, C]: the shape of a transform from pixels to tiles.
Status TilesShape(shape_inference::InferenceContext* c) {
  shape_inference::ShapeHandle input;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &input));
  shape_inference::DimensionHandle tiles = c->UnknownDim();
  if (c->ValueKnown(c->Dim(input, 0)) && c->ValueKnown(c->Dim(input, 1)) && c->ValueKnown(c->Dim(input, 2))) {
    tiles = c->MakeDim(c->Value(c->Dim(input, 0)) * ((c->Value(c->Dim(input, 1)) + kBlock - 1) / kBlock) *
                       ((c->Value(c->Dim(input, 2)) + kBlock - 1) / kBlock));
  }
  c->set_output(0, c->MakeShape({kPoints, tiles, c->Dim(input, 3)}));
  return Status();
}

REGISTER_OP("MrcnnWinogradInput")
    .Input("input: float")   // [B, H, W, C]
    .Output("tiles: float")  // [36, T, C]: V of every tile, point-major
    .SetShapeFn(TilesShape);

// The output transform's adjoint, for the kernel gradient: the gradient dM = A dY A^T of every tile's products
// from the gradient dY of its 4x4 output block (zero past the image's edge).
REGISTER_OP("MrcnnWinogradOutputAdjoint")
    .Input("output_grad: float")  // [B, H, W, C]
    .Output("tiles: float")       // [36, T, C]
    .SetShapeFn(TilesShape);

REGISTER_OP("MrcnnWinogradOutput")
    .Input("products: float")  // [36, T, C]: M of every tile
    .Input("size: int32")      // [3]: B, H, W of the output
    .Output("output: float")   // [B, H, W, C]
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

// The kernels below are compiled for AVX-512 and AVX2 too, picked when the library loads (target_clones): the
// library stays portable, and the build has no fused multiply-adds (-ffp-contract=off), so every clone rounds
// alike. The transforms' inputs and outputs exceed the caches and another op reads the result, so the kernels
// write with stores that bypass the caches: a plain store first reads the line it overwrites, and the 36 point
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

// r_i = sum_j B^T[i][j] x_j for 6 vectors x_j = x + j * x_step and r_i = r + i * r_step of n channels each
// (B^T's rows written out; restrict lets the compiler vectorize over the channels).
MRCNN_INLINE void InputRows(const float* __restrict__ x, int64_t x_step, float* __restrict__ r, int64_t r_step,
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

// The same with A (6 x 4, the transpose of the output transform's A^T): 4 vectors in, 6 out. A dY A^T is the
// gradient of the products M of a block whose output Y = A^T M A has the gradient dY.
MRCNN_INLINE void AdjointRows(const float* __restrict__ x, int64_t x_step, float* __restrict__ r, int64_t r_step,
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

// With A^T: 6 vectors in, 4 out.
MRCNN_INLINE void OutputRows(const float* __restrict__ x, int64_t x_step, float* __restrict__ r, int64_t r_step,
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

struct Grid {
  int64_t batch, height, width, tile_rows, tile_cols;
  int64_t tiles() const { return batch * tile_rows * tile_cols; }
};

Grid MakeGrid(int64_t batch, int64_t height, int64_t width) {
  return {batch, height, width, (height + kBlock - 1) / kBlock, (width + kBlock - 1) / kBlock};
}

using Rows = void (*)(const float*, int64_t, float*, int64_t, int);

// Tiles t in [begin, end) of `pixels` [B, H, W, C] into `tiles` [36, T, C]: each tile's side x side pixels
// from row 4 ty - margin and column 4 tx - margin (zero outside the image), transformed by kRows (6 x side)
// down its columns and along its rows.
template <int kSide, int kMargin, Rows kRows>
MRCNN_INLINE void PixelsToTiles(const Grid& grid, int64_t channels, const float* pixels, float* tiles,
                                bool streaming, int64_t begin, int64_t end) {
  const int64_t point_stride = grid.tiles() * channels;  // from one point's [T, C] to the next
  alignas(64) float d[kPoints][kChannelBlock];  // the tile's pixels, then its transform
  alignas(64) float rows[kTile * kSide][kChannelBlock];  // the transform of its columns
  for (int64_t t = begin; t < end; ++t) {
    const int64_t b = t / (grid.tile_rows * grid.tile_cols);
    const int64_t y0 = (t / grid.tile_cols) % grid.tile_rows * kBlock - kMargin;
    const int64_t x0 = t % grid.tile_cols * kBlock - kMargin;
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

// B^T d B of every 6x6 input tile d.
MRCNN_CLONES void InputTiles(const Grid& grid, int64_t channels, const float* pixels, float* tiles,
                             bool streaming, int64_t begin, int64_t end) {
  PixelsToTiles<kTile, 1, InputRows>(grid, channels, pixels, tiles, streaming, begin, end);
}

// A dY A^T of every 4x4 output block dY.
MRCNN_CLONES void AdjointTiles(const Grid& grid, int64_t channels, const float* pixels, float* tiles,
                               bool streaming, int64_t begin, int64_t end) {
  PixelsToTiles<kBlock, 0, AdjointRows>(grid, channels, pixels, tiles, streaming, begin, end);
}

// A^T M A of every tile's products M, into the output's 4x4 blocks (cut at the image's edge).
MRCNN_CLONES void OutputBlocks(const Grid& grid, int64_t channels, const float* products, float* output,
                               bool streaming, int64_t begin, int64_t end) {
  const int64_t point_stride = grid.tiles() * channels;
  alignas(64) float rows[kBlock * kTile][kChannelBlock];   // A^T M: [4][6]
  alignas(64) float block[kBlock * kBlock][kChannelBlock];  // A^T M A: [4][4]
  for (int64_t t = begin; t < end; ++t) {
    const int64_t b = t / (grid.tile_rows * grid.tile_cols);
    const int64_t y0 = (t / grid.tile_cols) % grid.tile_rows * kBlock;
    const int64_t x0 = t % grid.tile_cols * kBlock;
    for (int64_t c0 = 0; c0 < channels; c0 += kChannelBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kChannelBlock, channels - c0));
      // Down each column, rows[i][nu] = sum_xi A^T[i][xi] M[xi][nu]; then along each row,
      // Y[i][j] = sum_nu rows[i][nu] A^T[j][nu].
      for (int nu = 0; nu < kTile; ++nu) {
        OutputRows(products + nu * point_stride + t * channels + c0, kTile * point_stride, rows[nu],
                   kTile * kChannelBlock, n);
      }
      for (int i = 0; i < kBlock; ++i) {
        OutputRows(rows[i * kTile], kChannelBlock, block[i * kBlock], kChannelBlock, n);
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

// MrcnnWinogradInput and MrcnnWinogradOutputAdjoint: [B, H, W, C] -> [36, T, C] by `transform`.
class PixelsToTilesOp : public OpKernel {
 public:
  using Transform = void (*)(const Grid&, int64_t, const float*, float*, bool, int64_t, int64_t);

  PixelsToTilesOp(OpKernelConstruction* context, Transform transform) : OpKernel(context), transform_(transform) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& input = context->input(0);
    OP_REQUIRES(context, input.dims() == 4,
                InvalidArgument("input must be [B, H, W, C], got ", input.shape().DebugString()));
    const Grid grid = MakeGrid(input.dim_size(0), input.dim_size(1), input.dim_size(2));
    const int64_t channels = input.dim_size(3);
    Tensor* tiles_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({kPoints, grid.tiles(), channels}),
                                                     &tiles_tensor));
    const float* pixels = input.flat<float>().data();
    float* tiles = tiles_tensor->flat<float>().data();
    const bool streaming = CanStream(tiles, channels);
    ParallelFor(context, grid.tiles(), kPoints * channels * 12, [&](int64_t begin, int64_t end) {
      transform_(grid, channels, pixels, tiles, streaming, begin, end);
    });
  }

 private:
  const Transform transform_;
};

class WinogradInputOp : public PixelsToTilesOp {
 public:
  explicit WinogradInputOp(OpKernelConstruction* context) : PixelsToTilesOp(context, InputTiles) {}
};

class WinogradOutputAdjointOp : public PixelsToTilesOp {
 public:
  explicit WinogradOutputAdjointOp(OpKernelConstruction* context) : PixelsToTilesOp(context, AdjointTiles) {}
};

class WinogradOutputOp : public OpKernel {
 public:
  explicit WinogradOutputOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& products_tensor = context->input(0);
    const Tensor& size = context->input(1);
    OP_REQUIRES(context, products_tensor.dims() == 3 && products_tensor.dim_size(0) == kPoints,
                InvalidArgument("products must be [36, T, C], got ", products_tensor.shape().DebugString()));
    OP_REQUIRES(context, size.dims() == 1 && size.dim_size(0) == 3,
                InvalidArgument("size must be [3] (B, H, W), got ", size.shape().DebugString()));
    const auto dims = size.vec<int32_t>();
    OP_REQUIRES(context, dims(0) >= 0 && dims(1) >= 0 && dims(2) >= 0,
                InvalidArgument("size must be >= 0, got ", dims(0), "x", dims(1), "x", dims(2)));
    const Grid grid = MakeGrid(dims(0), dims(1), dims(2));
    const int64_t channels = products_tensor.dim_size(2);
    OP_REQUIRES(context, products_tensor.dim_size(1) == grid.tiles(),
                InvalidArgument("products hold ", products_tensor.dim_size(1), " tiles; an output of ",
                                dims(0), "x", dims(1), "x", dims(2), " has ", grid.tiles()));
    Tensor* output_tensor = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(
                                0, TensorShape({grid.batch, grid.height, grid.width, channels}), &output_tensor));
    const float* products = products_tensor.flat<float>().data();
    float* output = output_tensor->flat<float>().data();
    const bool streaming = CanStream(output, channels);
    ParallelFor(context, grid.tiles(), kPoints * channels * 8, [&](int64_t begin, int64_t end) {
      OutputBlocks(grid, channels, products, output, streaming, begin, end);
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("MrcnnWinogradInput").Device(tensorflow::DEVICE_CPU), WinogradInputOp);
REGISTER_KERNEL_BUILDER(Name("MrcnnWinogradOutput").Device(tensorflow::DEVICE_CPU), WinogradOutputOp);
REGISTER_KERNEL_BUILDER(Name("MrcnnWinogradOutputAdjoint").Device(tensorflow::DEVICE_CPU),
                        WinogradOutputAdjointOp);

}  // namespace
}  // namespace mrcnn
