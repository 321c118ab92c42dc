// float32 products on TF32 tensor cores: the operand split and one mma.sync tile. Device code.
#pragma once

#include <cstdint>

namespace mirage::cuda {

// v = hi + lo for the tensor cores, which read a register's top 19 bits as a TF32 value (an
// H200 reads 1 + 0x1fff ulp as 1). hi is v rounded to TF32 with two integer operations
// (cvt.rna.tf32 takes four with its NaN and Inf checks); lo, below half of hi's last bit, goes
// raw (whatever the hardware does with its low bits costs < 2^-21 of v: float32's accuracy, as
// the tests check). Without kSplit hi alone. A non-finite v makes lo NaN, so an infinite operand
// gives NaN where PyTorch's product is infinite (docs/ops.md): non-finite values still reach
// exactly the outputs they reach in PyTorch.
template <bool kSplit>
__device__ __forceinline__ void split(float v, uint32_t& hi, uint32_t& lo) {
  hi = (__float_as_uint(v) + 0x1000u) & 0xffffe000u;
  if constexpr (kSplit) lo = __float_as_uint(v - __uint_as_float(hi));
}

// c += a b for one m16n8k8 TF32 tile (fragments in the PTX ISA's layout).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace mirage::cuda
