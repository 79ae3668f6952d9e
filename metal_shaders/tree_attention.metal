// Tree attention for one packed forward: the body of an mx.fast.metal_kernel (MLX writes the signature).
//
// One SIMD group (32 threads) per (query, head). Keys are visited in prompt-position order, in tiles of 32
// positions that start at position 0, so the sums of a query are the same whether it runs alone or packed
// with others (lane i of tile k always holds position 32k + i). Only the key ranges of the query's block are
// read: its cached prefix, its ancestor blocks, its own block up to itself. f32 throughout.
//
// inputs : q [TQ, HQ, D], keys [S, HKV, D], values [S, HKV, D] (f32, row contiguous)
//          q_block [TQ], q_key [TQ] (the query's own key index), q_pos [TQ] (its prompt position)
//          ranges [B, R, 3] (first key, end key, position of the first key), n_ranges [B]   (int32)
// output : out [TQ, HQ, D] f32
// template: D, HQ, HKV, R, DPL = ceil(D / 32) (output dims per lane)
uint lane = thread_position_in_grid.x;
uint h = thread_position_in_grid.y;
uint t = thread_position_in_grid.z;
uint hk = h / (HQ / HKV);
int blk = q_block[t];
int qkey = q_key[t];
int qpos = q_pos[t];
int nr = n_ranges[blk];
const device float* qrow = q + ((size_t)t * HQ + h) * D;
const float scale = 1.0f / metal::sqrt((float)D);

float m = -INFINITY;
float l = 0.0f;
float acc[DPL];
for (int i = 0; i < DPL; i++) {
    acc[i] = 0.0f;
}
for (int p0 = 0; p0 <= qpos; p0 += 32) {
    int p = p0 + (int)lane;
    int key = -1;
    for (int r = 0; r < nr; r++) {
        const device int* rg = ranges + ((size_t)blk * R + r) * 3;
        if (p >= rg[2] && p < rg[2] + (rg[1] - rg[0])) {
            key = rg[0] + (p - rg[2]);
        }
    }
    if (p > qpos || key > qkey) {
        key = -1;
    }
    float s = -INFINITY;
    if (key >= 0) {
        const device float* krow = keys + ((size_t)key * HKV + hk) * D;
        float dot = 0.0f;
        for (int i = 0; i < D; i++) {
            dot = metal::fma(qrow[i], krow[i], dot);
        }
        s = dot * scale;
    }
    float tile_max = simd_max(s);
    if (tile_max == -INFINITY) {
        continue;  // no visible key in this tile (same answer for the whole SIMD group)
    }
    float m_new = metal::max(m, tile_max);
    float corr = metal::exp(m - m_new);
    float e = key >= 0 ? metal::exp(s - m_new) : 0.0f;
    l = l * corr + simd_sum(e);
    for (int i = 0; i < DPL; i++) {
        acc[i] *= corr;
    }
    for (int j = 0; j < 32; j++) {
        float ej = simd_shuffle(e, (ushort)j);
        int kj = simd_shuffle(key, (ushort)j);
        if (kj >= 0) {
            const device float* vrow = values + ((size_t)kj * HKV + hk) * D;
            for (int i = 0; i < DPL; i++) {
                uint d = lane + 32 * i;
                if (d < D) {
                    acc[i] = metal::fma(ej, vrow[d], acc[i]);
                }
            }
        }
    }
    m = m_new;
}
for (int i = 0; i < DPL; i++) {
    uint d = lane + 32 * i;
    if (d < D) {
        out[((size_t)t * HQ + h) * D + d] = acc[i] / l;
    }
}
