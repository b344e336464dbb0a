// The cuda-ipc transport's copy kernels (cuda_copy.py lays out their tables and launches them;
// CuPy compiles this file with NVRTC). Every pointer and length is 64-bit.
__device__ __forceinline__ void copy_one(const char* s, char* d, long long m, long long lane) {
    if ((((unsigned long long)s | (unsigned long long)d | (unsigned long long)m) & 15) == 0) {
        const uint4* s4 = (const uint4*)s;
        uint4* d4 = (uint4*)d;
        const long long m4 = m >> 4;
        long long i = lane;
        for (; i + 96 < m4; i += 128) {           // four 16-byte loads in flight per lane
            uint4 a = s4[i], b = s4[i + 32], c = s4[i + 64], e = s4[i + 96];
            d4[i] = a; d4[i + 32] = b; d4[i + 64] = c; d4[i + 96] = e;
        }
        // at most three words left per lane: every load before any store, so a short range
        // (a 1 KiB fragment is two words per lane) has its loads in flight together
        const bool ha = i < m4, hb = i + 32 < m4, hc = i + 64 < m4;
        uint4 a = make_uint4(0, 0, 0, 0), b = a, c = a;
        if (ha) a = s4[i];
        if (hb) b = s4[i + 32];
        if (hc) c = s4[i + 64];
        if (ha) d4[i] = a;
        if (hb) d4[i + 32] = b;
        if (hc) d4[i + 64] = c;
    } else {
        for (long long i = lane; i < m; i += 32) d[i] = s[i];
    }
}

extern "C" __global__ void copy_ranges(const long long* __restrict__ src, const long long* __restrict__ dst,
                                       const long long* __restrict__ len, long long n) {
    const long long lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (r >= n) return;
    long long s = src[r], d = dst[r], m = len[r];
    for (;;) {   // the next range's descriptor is loaded while this one is copied
        const long long q = r + warps;
        long long s2 = 0, d2 = 0, m2 = 0;
        if (q < n) { s2 = src[q]; d2 = dst[q]; m2 = len[q]; }
        copy_one((const char*)s, (char*)d, m, lane);
        if (q >= n) break;
        r = q; s = s2; d = d2; m = m2;
    }
}

// A fragmented set's runs (layer-major pages of one token: 0.5-1.2 KiB each) are bound by memory
// latency, not bandwidth: a warp copying one range at a time waits a round trip per range. So a
// warp takes BATCH rows at once, `warps` apart; when all are short (16-byte aligned, at most
// three 16-byte words per lane) every load of the batch is issued before any store:
//
//     lane:  load a0 a1 | load b0 | load c0 c1 | load d0 | store a0 a1 | store b0 | ...
//            ^ BATCH ranges' words in flight together
//
// One H100, device-local, 32 x 512 threads (docs/bench_transfer_gpu.json "batched_runs"): runs
// of 512 B / 1 KiB / 1152 B 1.77 / 2.03 / 3.67 -> 1.10 / 1.27 / 2.30 ms per 0.6-2.2 GB; 656 B
// runs (ending mid-sector: the batch gains nothing there) 3.24 -> 3.49. Longer or unaligned
// ranges go one by one through copy_one (2 KiB runs: 2.69 -> 2.75, pages: unchanged).
#define BATCH 4

__device__ __forceinline__ bool short_range(long long s, long long d, long long m) {
    return ((((unsigned long long)s | (unsigned long long)d | (unsigned long long)m) & 15) == 0) && m <= 1536;
}

extern "C" __global__ void copy_runs(const long long* __restrict__ t, long long n, long long b) {
    const long long lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const long long* sb = t + 3 * n;
    const long long* db = sb + b;
    const long long* it = db + b;
    const long long total = n * b;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < total; r += BATCH * warps) {
        long long s[BATCH], d[BATCH], m[BATCH];
        bool all_short = true;
#pragma unroll
        for (int k = 0; k < BATCH; k++) {   // row q = bi * n + i: run i of buffer bi
            const long long q = r + k * warps;
            s[k] = d[k] = m[k] = 0;
            if (q < total) {
                const long long bi = q / n, i = q - bi * n, x = it[bi];
                s[k] = sb[bi] + t[i] * x;
                d[k] = db[bi] + t[n + i] * x;
                m[k] = t[2 * n + i] * x;
            }
            all_short = all_short && short_range(s[k], d[k], m[k]);
        }
        if (all_short) {
            uint4 v[BATCH][3];
#pragma unroll
            for (int k = 0; k < BATCH; k++) {
                const uint4* p = (const uint4*)s[k];
                const long long w = m[k] >> 4;
#pragma unroll
                for (int j = 0; j < 3; j++)
                    if (lane + 32 * j < w) v[k][j] = p[lane + 32 * j];
            }
#pragma unroll
            for (int k = 0; k < BATCH; k++) {
                uint4* p = (uint4*)d[k];
                const long long w = m[k] >> 4;
#pragma unroll
                for (int j = 0; j < 3; j++)
                    if (lane + 32 * j < w) p[lane + 32 * j] = v[k][j];
            }
        } else {
#pragma unroll
            for (int k = 0; k < BATCH; k++)
                if (m[k]) copy_one((const char*)s[k], (char*)d[k], m[k], lane);
        }
    }
}

__device__ __forceinline__ int log2_of(long long d) {  // log2(d) for a power of two, else -1
    return (d > 0 && (d & (d - 1)) == 0) ? __ffsll(d) - 1 : -1;
}

__device__ __forceinline__ long long quot(long long x, long long d, int shift) {  // x / d, x >= 0
    if (shift >= 0) return x >> shift;
    return ((x | d) >> 31) ? x / d : (long long)((unsigned)x / (unsigned)d);  // 32-bit where it fits
}

__device__ __forceinline__ void copy_row_bytes(const char* s, char* d, long long ss, long long ds, long long row,
                                               long long k, long long lane) {   // any alignment
    const long long total = k * row;
    for (long long x = lane; x < total; x += 32) {
        const long long j = x / row, q = x - j * row;
        d[j * ds + q] = s[j * ss + q];
    }
}

__device__ __forceinline__ void copy_rows(const char* s, char* d, long long ss, long long ds, long long row,
                                          long long k, long long lane) {
    // k rows of `row` bytes, `ss` / `ds` apart: the warp's lanes take 16-byte words of all rows,
    // four loads in flight per lane before their stores (a TP slice of a row is 0.25-0.5 KiB:
    // one load at a time waited a round trip per word)
    if ((((unsigned long long)s | (unsigned long long)d | ss | ds | row) & 15) == 0) {
        const long long w = row >> 4, total = k * w;
        const int sh = log2_of(w);
        for (long long x = lane; x < total; x += 128) {
            uint4 v[4];
            long long to[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const long long y = x + 32 * u;
                if (y < total) {   // (no division for a slot past the end: a one-word row pays none)
                    const long long j = quot(y, w, sh), q = y - j * w;
                    v[u] = *(const uint4*)(s + j * ss + (q << 4));
                    to[u] = j * ds + (q << 4);
                }
            }
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (x + 32 * u < total) *(uint4*)(d + to[u]) = v[u];
        }
    } else {
        copy_row_bytes(s, d, ss, ds, row, k, lane);
    }
}

// One (run, lane) of a TP slice is small: gpt-oss at 8:1 is 16 rows of 128 B, a 1 KiB stride
// apart on one side, 2 KiB: four 16-byte words per lane. A warp taking one at a time waited
// for its descriptor, then for its words, a round trip each per 2 KiB. So a warp takes
// LANE_BATCH of them, `warps` apart: their descriptors load together and, when all are small
// (16-byte aligned, at most LANE_WORDS words per lane), every word of all of them loads before
// any store (4 KiB in flight per warp); others go one by one (copy_one, copy_rows).
// One H100, device-local, one gpt-oss-120b sender's table at 32k page 16, 32 x 512 threads
// (scripts/device/bench_lanes.py): 8:1 0.305 -> 0.246 ms, 1:8 0.311 -> 0.247, 2:1 0.870 -> 0.783,
// 4:1 0.496 -> 0.476; a batch of 3 or 4 spills registers (8:1 0.298, 0.425 ms).
#ifndef LANE_BATCH  // (scripts/device/bench_lanes.py compiles others to compare)
#define LANE_BATCH 2
#endif
#define LANE_WORDS 4

struct LaneItem {
    const char* s;
    char* d;
    long long ss, ds, row, k;   // strides, bytes per row, rows (k = 0: no item)
};

__device__ __forceinline__ LaneItem lane_item(const long long* t, const long long* L, long long q, long long n,
                                              long long b, long long srows, long long drows, int ssh, int dsh) {
    // row q = bi * n + i: run i of lane bi (L: per lane address, pitch, offset, stride (src,
    // dst), row bytes)
    const long long bi = quot(q, n, -1), i = q - bi * n, s = t[i], d = t[n + i];
    const long long sp = quot(s, srows, ssh), dp = quot(d, drows, dsh);
    LaneItem it;
    it.k = t[2 * n + i];
    it.ss = L[3 * b + bi];
    it.ds = L[7 * b + bi];
    it.row = L[8 * b + bi];
    it.s = (const char*)(L[bi] + sp * L[b + bi] + L[2 * b + bi] + (s - sp * srows) * it.ss);
    it.d = (char*)(L[4 * b + bi] + dp * L[5 * b + bi] + L[6 * b + bi] + (d - dp * drows) * it.ds);
    return it;
}

__device__ __forceinline__ bool small_item(const LaneItem& it) {  // (strides fit an int too)
    return ((((unsigned long long)it.s | (unsigned long long)it.d | it.ss | it.ds | it.row) & 15) == 0) &&
           it.k * (it.row >> 4) <= 32 * LANE_WORDS && ((it.ss | it.ds) >> 31) == 0;
}

// Two variants, both on by default since measured (issue 40; scripts/device/bench_lanes.py
// compiles others with --kernel NAME=PATH:DEFINE=V beside the default; the older loop is
// LANE_PREFETCH=0 LANE_CHUNKS=0). One H100, device-local, one gpt-oss-120b sender's table at 32k
// tokens, page 16, 64 x 512 threads, median of 20 (docs/bench_tp_gpu.json "session_9_lanes"):
// old -> both: 8:1 0.160 -> 0.151 ms, 8:2 0.168 -> 0.154, 1:8 0.169 -> 0.160, 4:1 0.303 -> 0.272,
// 2:1 0.601 -> 0.494 (a device copy of the same bytes: 0.116, 0.114, 0.116, 0.214, 0.421 ms);
// bytes equal to the old loop's on every pair; on the device 128 registers, 0 B local (no spill):
//   LANE_PREFETCH=1  software-pipelined: a batch's words load, then the NEXT batch's descriptors
//                    load and are worked out while those words are in flight, then the stores.
//                    Today each batch waits two dependent round trips (descriptors, then words);
//                    this waits the longer of the two. The next batch is held compact (what the
//                    small path needs: 8 registers an item); its raw t[] / L[] values live only
//                    between their loads and the arithmetic. A batch that is not all small
//                    copies first and loads the next one after (copy_rows needs the registers).
//   LANE_CHUNKS=1    an item too big for the small path (2:1, 4:1: 16 rows of 512 B or 256 B,
//                    8 KiB / 4 KiB) that is 16-byte aligned, strides < 2 GiB, is copied in chunks
//                    of LANE_BATCH x LANE_WORDS words per lane through the same registers: 4 KiB
//                    in flight per warp, against copy_rows' four words per lane (2 KiB). The copy
//                    is bound by bytes in flight (the launch takes at most `blocks` SMs, 16 warps
//                    each, 64 KiB an SM at 4 KiB a warp), and registers bound those: the default
//                    uses 123 of the 128 a thread has at 512 threads. Unaligned items go byte by
//                    byte, as copy_rows takes them (its aligned path beside the chunks spilled).
// Both combine. ptxas (CUDA 13.0, sm_90, -O3) registers / spilled bytes: default 123 / 0,
// PREFETCH 126 / 0, CHUNKS 124 / 0, both 128 / 0; PREFETCH at LANE_BATCH 1 108 / 0, at 3 128 / 80
// (the default at 3: 126 / 32). Orders tried for PREFETCH: the next batch's descriptors before
// this batch's loads spilled 8 bytes, the raw t[] values held across the copy 64-96.
// The word-to-lane map is not what limits: word y = lane + 32 u of an item is word y % w of row
// y / w (w words a row), so a 128 B row (gpt-oss, one head) is 8 consecutive lanes and one
// warp-wide load or store moves 4 whole rows, every 32 B sector of every 128 B line full;
// source rows are contiguous 512 B.
#ifndef LANE_PREFETCH
#define LANE_PREFETCH 1
#endif
#ifndef LANE_CHUNKS
#define LANE_CHUNKS 1
#endif

#if LANE_PREFETCH || LANE_CHUNKS
struct LaneTable {   // a launch's arguments and what every warp works out from them
    const long long* t;
    const long long* L;
    long long n, b, srows, drows, total, warps;
    int ssh, dsh;
};

struct LaneBatch {   // a batch's items, compact: what the small path needs
    const char* s[LANE_BATCH];
    char* d[LANE_BATCH];
    int ss[LANE_BATCH], ds[LANE_BATCH], w[LANE_BATCH], words[LANE_BATCH];
    bool small;   // every item present is small (an absent one has no words)
};

__device__ __forceinline__ LaneItem table_item(const LaneTable& T, long long q) {
    return lane_item(T.t, T.L, q, T.n, T.b, T.srows, T.drows, T.ssh, T.dsh);
}

__device__ __forceinline__ void lane_batch(LaneBatch& c, const LaneTable& T, long long r) {
    // items r, r + warps, ...: their descriptors load together (past the end: none)
    c.small = true;
#pragma unroll
    for (int k = 0; k < LANE_BATCH; k++) {
        const long long q = r + k * T.warps;
        c.s[k] = 0, c.d[k] = 0, c.ss[k] = c.ds[k] = 0, c.w[k] = 1, c.words[k] = 0;
        if (q < T.total) {
            const LaneItem it = table_item(T, q);
            c.small = c.small && small_item(it);
            c.s[k] = it.s, c.d[k] = it.d, c.ss[k] = (int)it.ss, c.ds[k] = (int)it.ds;
            c.w[k] = (int)(it.row >> 4), c.words[k] = (int)(it.k * (it.row >> 4));
        }
    }
}

template <int NW>   // words y0 + lane + 32 u (u < NW) of rows w words long, ss bytes apart
__device__ __forceinline__ void load_span(uint4 (&v)[NW], const char* s, int ss, int w, int words, int y0, int lane) {
    const int sh = log2_of(w);
#pragma unroll
    for (int u = 0; u < NW; u++) {
        const int y = y0 + lane + 32 * u;
        if (y < words) {
            const int j = sh >= 0 ? y >> sh : y / w, x = y - j * w;
            v[u] = *(const uint4*)(s + (long long)j * ss + (x << 4));
        }
    }
}

template <int NW>
__device__ __forceinline__ void store_span(const uint4 (&v)[NW], char* d, int ds, int w, int words, int y0, int lane) {
    const int sh = log2_of(w);
#pragma unroll
    for (int u = 0; u < NW; u++) {
        const int y = y0 + lane + 32 * u;
        if (y < words) {
            const int j = sh >= 0 ? y >> sh : y / w, x = y - j * w;
            *(uint4*)(d + (long long)j * ds + (x << 4)) = v[u];
        }
    }
}

__device__ __forceinline__ bool chunked_item(const LaneItem& it) {
    // aligned, and every word number (past the last word too: y0 + 255) an int
    return ((((unsigned long long)it.s | (unsigned long long)it.d | it.ss | it.ds | it.row) & 15) == 0) &&
           ((it.ss | it.ds | it.row | it.k) >> 31) == 0 && it.k * (it.row >> 4) < (1LL << 30);
}

__device__ __forceinline__ void copy_chunks(const LaneItem& it, int lane) {
    uint4 v[LANE_BATCH * LANE_WORDS];
    const int w = (int)(it.row >> 4), words = (int)(it.k * w);
#pragma unroll 1
    for (int y0 = 0; y0 < words; y0 += 32 * LANE_BATCH * LANE_WORDS) {
        load_span(v, it.s, (int)it.ss, w, words, y0, lane);
        store_span(v, it.d, (int)it.ds, w, words, y0, lane);
    }
}

__device__ __forceinline__ void copy_items(const LaneTable& T, long long r, long long lane) {
    for (int k = 0; k < LANE_BATCH && r + k * T.warps < T.total; k++) {   // one by one
        const LaneItem it = table_item(T, r + k * T.warps);
#if LANE_CHUNKS   // (copy_rows' four words in flight, beside the chunks, spilled registers)
        if (chunked_item(it)) copy_chunks(it, (int)lane);
        else copy_row_bytes(it.s, it.d, it.ss, it.ds, it.row, it.k, lane);
#else
        if (it.ss == it.row && it.ds == it.row) copy_one(it.s, it.d, it.k * it.row, lane);
        else copy_rows(it.s, it.d, it.ss, it.ds, it.row, it.k, lane);
#endif
    }
}

__device__ __forceinline__ void copy_small(const LaneBatch& c, const LaneTable& T, long long q, LaneBatch* next,
                                           int lane) {
    // every word of the batch loads before any store; `next` (when given) is batch q, its
    // descriptors loaded and worked out while these words are in flight
    uint4 v[LANE_BATCH][LANE_WORDS];
#pragma unroll
    for (int k = 0; k < LANE_BATCH; k++) load_span(v[k], c.s[k], c.ss[k], c.w[k], c.words[k], 0, lane);
    if (next) lane_batch(*next, T, q);
#pragma unroll
    for (int k = 0; k < LANE_BATCH; k++) store_span(v[k], c.d[k], c.ds[k], c.w[k], c.words[k], 0, lane);
}

__device__ __forceinline__ void lanes_pipelined(const LaneTable& T, long long r, int lane) {
    if (r >= T.total) return;
    LaneBatch c;
    lane_batch(c, T, r);
    for (;;) {
        const long long q = r + LANE_BATCH * T.warps;
        LaneBatch next;   // (this batch's stores read c after the next batch's descriptors load)
        if (c.small) {
            copy_small(c, T, q, &next, lane);
        } else {   // (copied first: the next batch's registers are free during copy_rows)
            copy_items(T, r, lane);
            lane_batch(next, T, q);
        }
        if (q >= T.total) return;
        r = q;
        c = next;
    }
}

__device__ __forceinline__ void lanes_plain(const LaneTable& T, long long r, int lane) {
    for (; r < T.total; r += LANE_BATCH * T.warps) {
        LaneBatch c;
        lane_batch(c, T, r);
        if (c.small) copy_small(c, T, r, 0, lane);
        else copy_items(T, r, lane);
    }
}

extern "C" __global__ void __launch_bounds__(512) copy_lanes(const long long* __restrict__ t, long long n,
                                                             long long b, long long srows, long long drows) {
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const LaneTable T = {t, t + 3 * n, n, b, srows, drows, n * b, warps, log2_of(srows), log2_of(drows)};
    const long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (LANE_PREFETCH) lanes_pipelined(T, r, threadIdx.x & 31);
    else lanes_plain(T, r, threadIdx.x & 31);
}
#else
extern "C" __global__ void __launch_bounds__(512) copy_lanes(const long long* __restrict__ t, long long n,
                                                             long long b, long long srows, long long drows) {
    const long long lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const long long* L = t + 3 * n;
    const long long total = n * b;
    const int ssh = log2_of(srows), dsh = log2_of(drows);
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < total; r += LANE_BATCH * warps) {
        const char* s[LANE_BATCH];   // the batch's items, compact: what the small path needs
        char* d[LANE_BATCH];
        int ss[LANE_BATCH], ds[LANE_BATCH], w[LANE_BATCH], words[LANE_BATCH];
        bool all_small = true;
#pragma unroll
        for (int k = 0; k < LANE_BATCH; k++) {
            const long long q = r + k * warps;
            s[k] = 0, d[k] = 0, ss[k] = ds[k] = 0, w[k] = 1, words[k] = 0;
            if (q < total) {
                const LaneItem it = lane_item(t, L, q, n, b, srows, drows, ssh, dsh);
                all_small = all_small && small_item(it);
                s[k] = it.s, d[k] = it.d, ss[k] = (int)it.ss, ds[k] = (int)it.ds;
                w[k] = (int)(it.row >> 4), words[k] = (int)(it.k * (it.row >> 4));
            }
        }
        if (all_small) {
            uint4 v[LANE_BATCH][LANE_WORDS];
#pragma unroll
            for (int k = 0; k < LANE_BATCH; k++) {
                const int sh = log2_of(w[k]);
#pragma unroll
                for (int u = 0; u < LANE_WORDS; u++) {
                    const int y = (int)lane + 32 * u;
                    if (y < words[k]) {
                        const int j = sh >= 0 ? y >> sh : y / w[k], x = y - j * w[k];
                        v[k][u] = *(const uint4*)(s[k] + (long long)j * ss[k] + (x << 4));
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < LANE_BATCH; k++) {
                const int sh = log2_of(w[k]);
#pragma unroll
                for (int u = 0; u < LANE_WORDS; u++) {
                    const int y = (int)lane + 32 * u;
                    if (y < words[k]) {
                        const int j = sh >= 0 ? y >> sh : y / w[k], x = y - j * w[k];
                        *(uint4*)(d[k] + (long long)j * ds[k] + (x << 4)) = v[k][u];
                    }
                }
            }
            continue;
        }
        for (int k = 0; k < LANE_BATCH && r + k * warps < total; k++) {   // one by one
            const LaneItem it = lane_item(t, L, r + k * warps, n, b, srows, drows, ssh, dsh);
            if (it.ss == it.row && it.ds == it.row) copy_one(it.s, it.d, it.k * it.row, lane);
            else copy_rows(it.s, it.d, it.ss, it.ds, it.row, it.k, lane);
        }
    }
}
#endif
