/* What the AMX kernels share (models/layers/int8_groups.c, int8_amx.c): Linux's permission
 * for the tile data, the tile configuration's memory layout and loading it. Included only
 * inside a kernel's x86-64 section (GCC >= 11 or Clang, compiled with AVX-512), whose
 * functions carry the AMX target attributes. */

#ifndef HYBRIDSERVE_AMX_TILES_H
#define HYBRIDSERVE_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* ldtilecfg's 64-byte operand (palette 1): each tile's bytes per row and rows. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* 1 where Linux lets this process use AMX's tile data (asked once per process), else 0. */
static inline int amx_request_tiles(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* Loads cfg into this thread's tile configuration. GCC's _tile_loadconfig tells the
 * compiler it reads one byte of cfg, so without the barrier the other fields' stores may be
 * dropped (ldtilecfg then faults). */
__attribute__((target("amx-tile"))) static inline void amx_load_config(const tile_config *cfg) {
    __asm__ __volatile__("" : : "r"(cfg) : "memory");
    _tile_loadconfig(cfg);
}

#endif
