// Fused residual add + RMSNorm: the body of an mx.fast.metal_kernel (MLX writes the signature).
//
// One threadgroup of THREADS threads per row: summed = x + residual, out = weight * summed / rms(summed).
// The sum of squares is accumulated in f32, each thread over a fixed stride, then reduced in a fixed tree,
// so a row's result does not depend on the other rows of the batch.
//
// inputs : x [T, H], residual [T, H], weight [H] (type T), eps [1] f32
// outputs: out [T, H], summed [T, H]
// template: T (dtype), H (hidden size), THREADS (threads per row, a multiple of 32, at most 1024)
uint tid = thread_position_in_threadgroup.x;
uint row = threadgroup_position_in_grid.y;
uint simd_lane = thread_index_in_simdgroup;
uint simd_id = simdgroup_index_in_threadgroup;
threadgroup float partial[32];
threadgroup float total;

const device T* xr = x + (size_t)row * H;
const device T* rr = residual + (size_t)row * H;
device T* sr = summed + (size_t)row * H;
float sq = 0.0f;
for (uint i = tid; i < H; i += THREADS) {
    T v = xr[i] + rr[i];
    sr[i] = v;
    float f = (float)v;
    sq = metal::fma(f, f, sq);
}
sq = simd_sum(sq);
if (simd_lane == 0) {
    partial[simd_id] = sq;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (simd_id == 0) {
    float s = simd_lane < THREADS / 32 ? partial[simd_lane] : 0.0f;
    s = simd_sum(s);
    if (simd_lane == 0) {
        total = s;
    }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float inv = metal::rsqrt(total / (float)H + eps[0]);
device T* outr = out + (size_t)row * H;
for (uint i = tid; i < H; i += THREADS) {
    outr[i] = weight[i] * (T)((float)sr[i] * inv);
}
