// Max-min codec kernels of cgx_ps/kernels/cuda (codec.py launches them); the definition is reference.py.
#define BLOCK 256
#define CACHED 2  // groups of 8 a thread keeps in registers between the min/max and the level pass

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ bool nonfinite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
}

// lowbias32, as rng.py
__device__ __forceinline__ u32 mix32(u32 x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}

// Load the group of 8 elements at x[i], of which m (1..8) exist; missing lanes repeat v[0],
// which changes neither the group's min nor its max.
__device__ __forceinline__ void load8(const float* __restrict__ x, long long i, int m, bool vec,
                                      float v[8]) {
    if (m == 8 && vec) {  // i is a multiple of 8, so both float4s are 16-byte aligned
        const float4 a = __ldg(reinterpret_cast<const float4*>(x + i));
        const float4 b = __ldg(reinterpret_cast<const float4*>(x + i) + 1);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = __ldg(x + i + (k < m ? k : 0));
    }
}

__device__ __forceinline__ void scan8(const float v[8], long long i, float& mn, float& mx,
                                      u64& first_bad) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        mn = fminf(mn, v[k]);
        mx = fmaxf(mx, v[k]);
        if (nonfinite(v[k]) && (u64)(i + k) < first_bad) first_bad = (u64)(i + k);
    }
}

// Levels of m (1..8) elements starting at global index i, packed LSB-first into a u64:
// level = clamp(floor((x - mn) * scale + r), 0, max_level), one rounding per operation.
__device__ __forceinline__ u64 quantize8(const float v[8], long long i, int m, float mn,
                                         float scale, float max_level, int bits, int stochastic,
                                         u32 key) {
    // rng.py: h(i) = mix(i_lo ^ s ^ mix(i_hi)); a group never straddles 2**32, so i_hi is fixed
    const u32 k_hi = key ^ mix32((u32)((u64)i >> 32));
    u64 out = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        if (k < m) {
            float r = 0.5f;
            if (stochastic) {
                const u32 h = mix32(((u32)(u64)i + (u32)k) ^ k_hi);
                r = __fmul_rn(__uint2float_rn(h >> 8), 5.9604644775390625e-08f);  // 2**-24
            }
            float t = floorf(__fadd_rn(__fmul_rn(__fsub_rn(v[k], mn), scale), r));
            // fmaxf maps NaN (0 * inf, a subnormal unit) to 0 like the reference; inf clamps
            t = fminf(fmaxf(t, 0.0f), max_level);
            out |= (u64)(u32)t << (k * bits);
        }
    }
    return out;
}

// `nbytes` bytes of v at p (p = packed + 8-aligned base + group * bits): one aligned store when
// bits is 1, 2, 4 or 8 and the group is whole, else single bytes.
__device__ __forceinline__ void store_bytes(unsigned char* p, u64 v, int nbytes, int bits) {
    if (nbytes == bits) {
        switch (bits) {
            case 1: *p = (unsigned char)v; return;
            case 2: *reinterpret_cast<unsigned short*>(p) = (unsigned short)v; return;
            case 4: *reinterpret_cast<u32*>(p) = (u32)v; return;
            case 8: *reinterpret_cast<u64*>(p) = v; return;
        }
    }
    for (int j = 0; j < nbytes; ++j) p[j] = (unsigned char)(v >> (8 * j));
}

__device__ __forceinline__ u64 load_bytes(const unsigned char* p, int nbytes, int bits) {
    if (nbytes == bits) {
        switch (bits) {
            case 1: return *p;
            case 2: return *reinterpret_cast<const unsigned short*>(p);
            case 4: return *reinterpret_cast<const u32*>(p);
            case 8: return *reinterpret_cast<const u64*>(p);
        }
    }
    u64 v = 0;
    for (int j = 0; j < nbytes; ++j) v |= (u64)p[j] << (8 * j);
    return v;
}

// status[0]: lowest index of a NaN/Inf element, status[1]: lowest bucket whose max - min
// overflows; both start at ~0 (-1 as int64) and only ever decrease (atomicMin).
extern "C" __global__ void __launch_bounds__(BLOCK)
maxmin_encode(const float* __restrict__ x, long long n, int bucket_size, int bits, int tpb,
              int stochastic, u32 key, float* __restrict__ meta,
              unsigned char* __restrict__ packed, u64* __restrict__ status) {
    __shared__ float s_mn[BLOCK / 32], s_mx[BLOCK / 32];
    const int seg = threadIdx.x / tpb;   // which bucket of the block's batch
    const int lane = threadIdx.x % tpb;  // thread within that bucket
    const int per_block = BLOCK / tpb;
    const int width = tpb < 32 ? tpb : 32;
    const float max_level = (float)((1 << bits) - 1);
    const float inf = __int_as_float(0x7f800000);
    const bool vec = ((u64)x & 15) == 0;
    const long long nb = (n + bucket_size - 1) / bucket_size;
    u64 first_bad = ~0ull;

    // Block-uniform loop: every thread runs every iteration, so shuffles and barriers are safe.
    for (long long base = (long long)blockIdx.x * per_block; base < nb;
         base += (long long)gridDim.x * per_block) {
        const long long b = base + seg;
        const long long start = b * bucket_size;
        const long long rest = n - start;
        const int m = b < nb ? (rest < bucket_size ? (int)rest : bucket_size) : 0;
        const int groups = (m + 7) / 8;
        float v[CACHED][8];
        float mn = inf, mx = -inf;

#pragma unroll
        for (int c = 0; c < CACHED; ++c) {
            const int g = lane + c * tpb;
            if (g < groups) {
                const int gm = m - 8 * g < 8 ? m - 8 * g : 8;
                load8(x, start + 8 * g, gm, vec, v[c]);
                scan8(v[c], start + 8 * g, mn, mx, first_bad);
            }
        }
        for (int g = lane + CACHED * tpb; g < groups; g += tpb) {  // buckets over 4096 elements
            float w[8];
            const int gm = m - 8 * g < 8 ? m - 8 * g : 8;
            load8(x, start + 8 * g, gm, vec, w);
            scan8(w, start + 8 * g, mn, mx, first_bad);
        }

        // Reduce over the bucket's threads: xor offsets below `width` stay inside the segment.
        for (int off = width >> 1; off > 0; off >>= 1) {
            mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, off));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        }
        if (tpb > 32) {  // several warps per bucket: combine their partials in shared memory
            if ((threadIdx.x & 31) == 0) {
                s_mn[threadIdx.x >> 5] = mn;
                s_mx[threadIdx.x >> 5] = mx;
            }
            __syncthreads();
            const int first = seg * (tpb >> 5);
            mn = s_mn[first];
            mx = s_mx[first];
            for (int w = 1; w < (tpb >> 5); ++w) {
                mn = fminf(mn, s_mn[first + w]);
                mx = fmaxf(mx, s_mx[first + w]);
            }
            __syncthreads();  // s_mn/s_mx are rewritten by the next batch
        }
        // "+ 0" turns a -0.0 extreme into +0.0, as the reference does
        mn = __fadd_rn(mn, 0.0f);
        mx = __fadd_rn(mx, 0.0f);
        const float unit = __fdiv_rn(__fsub_rn(mx, mn), max_level);
        // 1/unit overflows for a subnormal unit: such a bucket encodes like a constant one.
        float scale = unit > 0.0f ? __frcp_rn(unit) : 0.0f;
        if (isinf(scale)) scale = 0.0f;
        if (m > 0 && lane == 0) {
            *reinterpret_cast<float2*>(meta + 2 * b) = make_float2(mn, unit);
            if (nonfinite(unit)) atomicMin(status + 1, (u64)b);
        }

#pragma unroll
        for (int c = 0; c < CACHED; ++c) {
            const int g = lane + c * tpb;
            if (g < groups) {
                const int gm = m - 8 * g < 8 ? m - 8 * g : 8;
                const long long gi = start / 8 + g;  // global group index
                const u64 lv = quantize8(v[c], 8 * gi, gm, mn, scale, max_level, bits,
                                         stochastic, key);
                store_bytes(packed + gi * bits, lv, (gm * bits + 7) / 8, bits);
            }
        }
        for (int g = lane + CACHED * tpb; g < groups; g += tpb) {  // reloads hit L1/L2
            float w[8];
            const int gm = m - 8 * g < 8 ? m - 8 * g : 8;
            const long long gi = start / 8 + g;
            load8(x, 8 * gi, gm, vec, w);
            const u64 lv = quantize8(w, 8 * gi, gm, mn, scale, max_level, bits, stochastic, key);
            store_bytes(packed + gi * bits, lv, (gm * bits + 7) / 8, bits);
        }
    }
    if (first_bad != ~0ull) atomicMin(status, first_bad);
}

// status[0]: lowest bucket whose metadata is invalid (non-finite min or unit, unit < 0, or
// min + unit * max_level not finite), starting at ~0.
extern "C" __global__ void __launch_bounds__(BLOCK)
maxmin_check_meta(const float2* __restrict__ meta, long long nb, int bits,
                  u64* __restrict__ status) {
    const float max_level = (float)((1 << bits) - 1);
    for (long long b = (long long)blockIdx.x * BLOCK + threadIdx.x; b < nb;
         b += (long long)gridDim.x * BLOCK) {
        const float2 mu = meta[b];
        const float top = __fadd_rn(mu.x, __fmul_rn(mu.y, max_level));
        if (nonfinite(mu.x) || nonfinite(mu.y) || !(mu.y >= 0.0f) || nonfinite(top))
            atomicMin(status, (u64)b);
    }
}

// out[i] = min + unit * level (two roundings), or out[i] += that; meta already validated.
extern "C" __global__ void __launch_bounds__(BLOCK)
maxmin_decode(const float2* __restrict__ meta, const unsigned char* __restrict__ packed,
              long long n, int bucket_size, int bits, int accumulate, float* __restrict__ out) {
    const long long groups = (n + 7) / 8;
    const long long groups_per_bucket = bucket_size / 8;
    const u32 mask = (1u << bits) - 1u;
    const bool vec = ((u64)out & 15) == 0;
    for (long long g = (long long)blockIdx.x * BLOCK + threadIdx.x; g < groups;
         g += (long long)gridDim.x * BLOCK) {
        const long long i = 8 * g;
        const int m = n - i < 8 ? (int)(n - i) : 8;
        const float2 mu = meta[g / groups_per_bucket];
        const u64 lv = load_bytes(packed + g * bits, (m * bits + 7) / 8, bits);
        float y[8];
#pragma unroll
        for (int k = 0; k < 8; ++k)
            y[k] = __fadd_rn(mu.x, __fmul_rn(mu.y, (float)((u32)(lv >> (k * bits)) & mask)));
        if (m == 8 && vec) {
            float4* o = reinterpret_cast<float4*>(out + i);
            float4 a = make_float4(y[0], y[1], y[2], y[3]);
            float4 c = make_float4(y[4], y[5], y[6], y[7]);
            if (accumulate) {
                const float4 p = o[0], q = o[1];
                a = make_float4(__fadd_rn(p.x, a.x), __fadd_rn(p.y, a.y),
                                __fadd_rn(p.z, a.z), __fadd_rn(p.w, a.w));
                c = make_float4(__fadd_rn(q.x, c.x), __fadd_rn(q.y, c.y),
                                __fadd_rn(q.z, c.z), __fadd_rn(q.w, c.w));
            }
            o[0] = a;
            o[1] = c;
        } else {
#pragma unroll  // constant indices keep y[] in registers
            for (int k = 0; k < 8; ++k)
                if (k < m) out[i + k] = accumulate ? __fadd_rn(out[i + k], y[k]) : y[k];
        }
    }
}
