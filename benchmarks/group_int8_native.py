"""Hand-written kernels for int8 groups (the GGUF's blocks at their own precision) against
the bf16 linear, per call: what native code reaches where torch has no kernel.

    python benchmarks/group_int8_native.py                     # 1, 16, 64, 1024 rows; 1 and 2 threads
    python benchmarks/group_int8_native.py --rows 16,64 --threads 1 --repeat 15

benchmarks/group_int8_rows.py found no torch kernel that multiplies int8 values with a
float scale per group of 32 near bf16's speed (results/group_int8_kernels.md). This builds
three (torch.utils.cpp_extension at the first run: a C++ compiler and an AVX-512 CPU with
avx512_bf16; `amx` only where the CPU has AMX) and times them on the same random weights
(Q5_0's values, a float32 scale per 32, --layers copies of each of Gemma 3 270M's decoder
shapes), interleaved with `bf16` (models/layers/linear.make_linear: oneDNN's packed bf16
GEMM). Every kernel keeps the file's values exactly: each group's products are summed in
float32 and the sum multiplied once by the group's scale, so its error column (of its
float32 output, against the float32 product of the exact weight) is float32 rounding
alone; bf16's error column is of its bf16 output, the weight rounded to bf16 included.
Every timed call rounds the output to bf16, as the model takes it.
- `fma`: per tile of 16 output columns and one group, the 32 x 16 values expanded once
  to float32 in L1, then for each block of 8 rows one FMA per value (x as float32);
- `dpbf16`: the same with x in bf16 and the values expanded to bf16 (exact for int8),
  AVX512-BF16's pair dot product `vdpbf16ps`;
- `amx`: per tile of 16 output columns all groups' values expanded to bf16 once (B tiles),
  then for each block of 16 rows (the input padded with zero rows to a multiple of 16)
  one AMX tile product per group (K = 32: one `tdpbf16ps`), four groups in flight, each
  stored and added times its scale to 16 output registers.
The vector kernels run up to VECTOR_MAX_ROWS rows, `amx` from 2 rows on. Prints the
median microseconds per call of bf16 and each kernel's ratio to it.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hybridserve, whatever is installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import torch_header  # noqa: E402
from group_int8_rows import GROUP, Q5_0_RANGE, SHAPES, table_arguments  # noqa: E402  (this folder is on sys.path)
from hybridserve.models.layers.linear import make_linear  # noqa: E402
from hybridserve.models.platform.cpu_features import read_cpu_flags  # noqa: E402

TILE = 16  # output columns per tile: one AVX-512 vector of float32
AMX_ROWS = 16  # rows per AMX tile: the AMX kernel's input is padded to a multiple
VECTOR_PATHS = ("fma", "dpbf16")
VECTOR_MAX_ROWS = 64  # the vector kernels' time grows with the rows: not run at prefill sizes

Kernel = Callable[[torch.Tensor], torch.Tensor]

_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>

// One kernel body; EXPAND fills buf with the group's values for one 16-column tile,
// PRODUCT(acc, row pointer, j) adds the products of step j to acc, STEPS steps per group.
#define GROUP_KERNEL(NAME, XTYPE, XPTR, BUFTYPE, STEPS, EXPAND, PRODUCT)                      \
torch::Tensor NAME(torch::Tensor x, torch::Tensor w, torch::Tensor s, int64_t n) {             \
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;                                       \
  auto out = torch::zeros({M, n}, torch::kFloat32);                                             \
  const XTYPE* xp = XPTR;                                                                       \
  const int8_t* wp = w.data_ptr<int8_t>();                                                      \
  const float* sp = s.data_ptr<float>();                                                        \
  float* op = out.data_ptr<float>();                                                            \
  _Pragma("omp parallel for schedule(static)")                                                  \
  for (int64_t nb = 0; nb < n / 16; ++nb) {                                                     \
    alignas(64) BUFTYPE buf[STEPS];                                                             \
    for (int64_t g = 0; g < G; ++g) {                                                           \
      const int8_t* wg = wp + (nb * K + g * 32) * 16;                                           \
      for (int j = 0; j < STEPS; ++j) { EXPAND; }                                               \
      const __m512 scale = _mm512_loadu_ps(sp + (nb * G + g) * 16);                            \
      for (int64_t m = 0; m < M; m += 8) {                                                      \
        const int rows = M - m < 8 ? (int)(M - m) : 8;                                          \
        __m512 acc[8];                                                                          \
        for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();                               \
        if (rows == 8) {                                                                        \
          for (int j = 0; j < STEPS; ++j)                                                       \
            for (int i = 0; i < 8; ++i) { const XTYPE* xr = xp + (m + i) * K + g * 32; PRODUCT; } \
        } else {                                                                                \
          for (int i = 0; i < rows; ++i)                                                        \
            for (int j = 0; j < STEPS; ++j) { const XTYPE* xr = xp + (m + i) * K + g * 32; PRODUCT; } \
        }                                                                                       \
        for (int i = 0; i < rows; ++i) {                                                        \
          float* o = op + (m + i) * n + nb * 16;                                                \
          _mm512_storeu_ps(o, _mm512_fmadd_ps(acc[i], scale, _mm512_loadu_ps(o)));              \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
  }                                                                                             \
  return out;                                                                                   \
}

// w [N/16, K, 16]: 16 values of one input column j per step, expanded to float32.
GROUP_KERNEL(group_fma, float, x.data_ptr<float>(), __m512, 32,
  buf[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wg + j * 16)))),
  acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xr[j]), buf[j], acc[i]))

// The same bytes read as [N/16, K/2, 16, 2]: a pair of input columns for 16 outputs per step.
GROUP_KERNEL(group_dpbf16, uint16_t, (const uint16_t*)x.data_ptr<at::BFloat16>(), __m512bh, 16,
  const __m256i v = _mm256_loadu_si256((const __m256i*)(wg + j * 32));
  buf[j] = _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))),
                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)))),
  acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(((const uint32_t*)xr)[j]), buf[j]))

#include <sys/syscall.h>
#include <unistd.h>
#include <vector>

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// AMX: x bf16 [M, K] with M a multiple of 16 and K of 128; w in the pair layout
// [N/16, K/2, 16, 2]. Per tile of 16 columns, every group's values are expanded to bf16 once
// (B tiles, K * 32 bytes, in L1 or L2); then for each block of 16 rows the 16 x 16 output
// stays in 16 registers while, four groups at a time, each group's tile product (K = 32:
// one AMX bf16 step) goes to its own accumulator tile, is stored, and is added times the
// group's scale.
torch::Tensor group_amx(torch::Tensor x, torch::Tensor w, torch::Tensor s, int64_t n) {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  TORCH_CHECK(permitted, "AMX tile data not permitted");
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  TORCH_CHECK(M % 16 == 0 && K % 128 == 0, "rows must be a multiple of 16, columns of 128");
  auto out = torch::empty({M, n}, torch::kFloat32);
  const uint16_t* xp = (const uint16_t*)x.data_ptr<at::BFloat16>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  #pragma omp parallel
  {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    std::vector<__m512bh> b(K / 2);
    alignas(64) float c[4][16][16];
    #pragma omp for schedule(static)
    for (int64_t nb = 0; nb < n / 16; ++nb) {
      const int8_t* wn = wp + nb * K * 16;
      for (int64_t j = 0; j < K / 2; ++j) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(wn + j * 32));
        b[j] = _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))),
                                   _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))));
      }
      const float* sn = sp + nb * G * 16;
      for (int64_t m = 0; m < M; m += 16) {
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        const uint16_t* xm = xp + m * K;
        for (int64_t g = 0; g < G; g += 4) {
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
          _tile_loadd(4, xm + (g + 0) * 32, K * 2); _tile_loadd(6, &b[(g + 0) * 16], 64); _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(5, xm + (g + 1) * 32, K * 2); _tile_loadd(7, &b[(g + 1) * 16], 64); _tile_dpbf16ps(1, 5, 7);
          _tile_loadd(4, xm + (g + 2) * 32, K * 2); _tile_loadd(6, &b[(g + 2) * 16], 64); _tile_dpbf16ps(2, 4, 6);
          _tile_loadd(5, xm + (g + 3) * 32, K * 2); _tile_loadd(7, &b[(g + 3) * 16], 64); _tile_dpbf16ps(3, 5, 7);
          _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64); _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
          for (int t = 0; t < 4; ++t) {
            const __m512 scale = _mm512_loadu_ps(sn + (g + t) * 16);
            for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(_mm512_load_ps(c[t][i]), scale, acc[i]);
          }
        }
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(op + (m + i) * n + nb * 16, acc[i]);
      }
    }
    _tile_release();
  }
  return out;
}
"""


def _build():  # type: ignore[no-untyped-def]
    from torch.utils.cpp_extension import load_inline

    return load_inline("hybridserve_group_int8_bench", cpp_sources=_SOURCE,
                       functions=["group_fma", "group_dpbf16", "group_amx"],
                       extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mamx-tile",
                                     "-mamx-bf16", "-fopenmp"], extra_ldflags=["-fopenmp"])


def _layouts(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [N/16, K, 16] for `fma`, the pair layout [N/16, K/2, 16, 2] for `dpbf16` and
    `amx`, scales [N/16, K/32, 16]) of int8 values `q` [N, K] and scales `s` [N, K/32]."""
    n, k = q.shape
    tiles = q.view(n // TILE, TILE, k)
    return (tiles.permute(0, 2, 1).contiguous(), tiles.view(n // TILE, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous(),
            s.view(n // TILE, TILE, k // GROUP).permute(0, 2, 1).contiguous())


def _padded(x: torch.Tensor) -> torch.Tensor:
    """x with zero rows appended up to a multiple of AMX_ROWS (the AMX kernel's row blocks)."""
    return torch.cat([x, x.new_zeros(-x.shape[0] % AMX_ROWS, x.shape[1])]) if x.shape[0] % AMX_ROWS else x


def _kernels(ext, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, dict[str, Kernel]]:  # type: ignore[no-untyped-def]
    """(the exact float32 weight, {path: bf16 x -> float32 x W^T}) for one random weight."""
    q = torch.randint(*Q5_0_RANGE, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, k // GROUP, generator=g) * 2e-3
    w = (q.view(n, k // GROUP, GROUP).float() * s[..., None]).view(n, k)
    values, pairs, scales = _layouts(q, s)
    dense = make_linear(w.bfloat16(), None)[0]
    return w, {"bf16": lambda x: dense(x).float(),
               "fma": lambda x: ext.group_fma(x.float(), values, scales, n),
               "dpbf16": lambda x: ext.group_dpbf16(x, pairs, scales, n),
               "amx": lambda x: ext.group_amx(_padded(x), pairs, scales, n)[: x.shape[0]]}


def _table(ext, paths: list[str], rows_list: list[int], layers: int, repeat: int, g: torch.Generator) -> None:  # type: ignore[no-untyped-def]
    made = {name: [_kernels(ext, n, k, g) for _ in range(layers)] for name, (n, k) in SHAPES.items()}
    print("\n| shape | rows | bf16 us | " + " | ".join(f"{p} / bf16" for p in paths[1:]) + " | "
          + " | ".join(f"{p} error" for p in paths) + " |\n|---|---:|" + "---:|" * (2 * len(paths)))
    for rows in rows_list:
        live = [p for p in paths if (rows <= VECTOR_MAX_ROWS or p not in VECTOR_PATHS) and (rows > 1 or p != "amx")]
        for name, copies in made.items():
            used = copies if rows <= 64 else copies[:2]  # prefill sizes are compute-bound: two copies suffice
            x = torch.randn(rows, SHAPES[name][1], generator=g).bfloat16()
            w, first = used[0]
            exact = F.linear(x.float(), w)
            err = {p: ((first[p](x) - exact).norm() / exact.norm()).item() for p in live}
            times: dict[str, list[float]] = {p: [] for p in live}
            for _ in range(repeat + 1):  # the first pass of each is a warm-up
                for p in live:
                    t0 = time.perf_counter()
                    for _, kernels in used:
                        kernels[p](x).bfloat16()  # every path's output rounded to bf16, as the model takes it
                    times[p].append((time.perf_counter() - t0) / len(used))
            med = {p: statistics.median(t[1:]) * 1e6 for p, t in times.items()}
            print(f"| {name} | {rows} | {med['bf16']:.0f} | "
                  + " | ".join(f"{med[p] / med['bf16']:.2f}" if p in med else "-" for p in paths[1:]) + " | "
                  + " | ".join(f"{err[p]:.1e}" if p in err else "-" for p in paths) + " |", flush=True)


def main() -> int:
    a = table_arguments(__doc__, "1,16,64,1024", 9).parse_args()
    flags = read_cpu_flags()
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags:
        print("group_int8_native: the kernels need avx512f/bw/vl and avx512_bf16", file=sys.stderr)
        return 2
    ext = _build()
    paths = ["bf16", "fma", "dpbf16"] + (["amx"] if "amx_bf16" in flags else [])
    g = torch.Generator().manual_seed(0)
    for threads in (int(t) for t in a.threads.split(",")):
        print(f"\n## {torch_header(threads, ('avx512_bf16', 'amx'))}")
        _table(ext, paths, [int(r) for r in a.rows.split(",")], a.layers, a.repeat, g)
    return 0


if __name__ == "__main__":
    sys.exit(main())
