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

extern "C" __global__ void copy_runs(const long long* __restrict__ t, long long n, long long b) {
    const long long lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const long long* sb = t + 3 * n;
    const long long* db = sb + b;
    const long long* it = db + b;
    const long long total = n * b;
    long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (r >= total) return;
    long long bi = r / n, i = r - bi * n;
    long long ts = t[i], td = t[n + i], tc = t[2 * n + i], xs = sb[bi], xd = db[bi], xi = it[bi];
    for (;;) {   // the next run's descriptor is loaded while this one is copied
        const char* s = (const char*)(xs + ts * xi);
        char* d = (char*)(xd + td * xi);
        const long long m = tc * xi;
        const long long q = r + warps;
        if (q < total) {
            bi = q / n; i = q - bi * n;
            ts = t[i]; td = t[n + i]; tc = t[2 * n + i]; xs = sb[bi]; xd = db[bi]; xi = it[bi];
        }
        copy_one(s, d, m, lane);
        if (q >= total) break;
        r = q;
    }
}

__device__ __forceinline__ void copy_rows(const char* s, char* d, long long ss, long long ds, long long row,
                                          long long k, long long lane) {
    // k rows of `row` bytes, `ss` / `ds` apart: the warp's lanes take 16-byte words of all rows
    if ((((unsigned long long)s | (unsigned long long)d | ss | ds | row) & 15) == 0) {
        const long long w = row >> 4, total = k * w;
        for (long long x = lane; x < total; x += 32) {
            const long long j = x / w, q = x - j * w;
            ((uint4*)(d + j * ds))[q] = ((const uint4*)(s + j * ss))[q];
        }
    } else {
        const long long total = k * row;
        for (long long x = lane; x < total; x += 32) {
            const long long j = x / row, q = x - j * row;
            d[j * ds + q] = s[j * ss + q];
        }
    }
}

extern "C" __global__ void copy_lanes(const long long* __restrict__ t, long long n, long long b,
                                      long long srows, long long drows) {
    const long long lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const long long* L = t + 3 * n;   // per lane: address, pitch, offset, stride (src, dst), row bytes
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n * b; r += warps) {
        const long long bi = r / n, i = r - bi * n, s = t[i], d = t[n + i], k = t[2 * n + i];
        const long long ss = L[3 * b + bi], ds = L[7 * b + bi], row = L[8 * b + bi];
        const char* src = (const char*)(L[bi] + s / srows * L[b + bi] + L[2 * b + bi] + s % srows * ss);
        char* dst = (char*)(L[4 * b + bi] + d / drows * L[5 * b + bi] + L[6 * b + bi] + d % drows * ds);
        if (ss == row && ds == row) copy_one(src, dst, k * row, lane);
        else copy_rows(src, dst, ss, ds, row, k, lane);
    }
}
