/* fastbatch.c — the one-copy batch gather behind fastbatch.stack, and the result lines' frame behind
 * warmd.format_outcome (at the end).
 *
 * Python checks shapes and dtypes and allocates every buffer (usually a slot of a pinned ring
 * reused batch after batch); this file only moves bytes: B source rows into one contiguous
 * destination, split over pthreads above a size threshold.
 * cffi's out-of-line API mode releases the GIL around each call, so a prefetch thread gathering
 * here does not stall the Python thread driving the model.
 */
#include "fastbatch.h"

#include <pthread.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define FB_MAX_THREADS 64    /* more than any host's memory bandwidth can use */
#define FB_GRAIN 4096        /* gather splits on page boundaries: whole pages per thread */

typedef struct fb_job fb_job;
struct fb_job {
    void (*work)(const fb_job *);
    char *dst;
    const char *const *srcs;
    int64_t item_bytes;       /* bytes per source */
    int stream;               /* write dst with non-temporal stores (see copy_bytes) */
    int64_t begin, end;       /* byte range of dst */
};

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static int overlaps(const char *a, int64_t an, const char *b, int64_t bn) {
    uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
    return an > 0 && bn > 0 && a0 < b0 + (uintptr_t)bn && b0 < a0 + (uintptr_t)an;
}

/* memcpy, or with stream set (x86) non-temporal stores: the destination lines bypass the cache,
 * which saves reading each one in before it is overwritten (a third of a plain copy's memory
 * traffic; measured +40 % on a 512 MiB batch). The cost: the batch is not left in cache, which a
 * CPU reader of a small batch would miss, hence only above stream_min_bytes. */
static void copy_bytes(char *d, const char *s, int64_t n, int stream) {
#if defined(__SSE2__)
    if (stream && n >= 256) {
        int64_t head = (int64_t)(-(uintptr_t)d & 15);
        memcpy(d, s, (size_t)head);
        d += head, s += head, n -= head;
        for (; n >= 64; d += 64, s += 64, n -= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
    }
#else
    (void)stream;  /* no portable streaming store: plain memcpy */
#endif
    memcpy(d, s, (size_t)n);
}

/* Non-temporal stores are weakly ordered: fence them before the thread reports done. */
static void stream_fence(int stream) {
#if defined(__SSE2__)
    if (stream) _mm_sfence();
#else
    (void)stream;
#endif
}

/* Bytes [begin, end) of the destination; a range may start or stop inside a source. */
static void gather_range(const fb_job *j) {
    const int64_t n = j->item_bytes;
    for (int64_t off = j->begin; off < j->end;) {
        int64_t i = off / n, within = off - i * n;
        int64_t k = min64(n - within, j->end - off);
        copy_bytes(j->dst + off, j->srcs[i] + within, k, j->stream);
        off += k;
    }
    stream_fence(j->stream);
}

static void *job_main(void *arg) {
    const fb_job *j = arg;
    j->work(j);
    return NULL;
}

/* Run proto over [0, units) cut into up to n_threads ranges, each boundary rounded down to a
 * multiple of grain. The calling thread does the first range itself, so t threads cost t - 1
 * pthread_create calls (~10-20 us each: the reason small batches stay on one thread). */
static int run_split(const fb_job *proto, int64_t units, int64_t grain, int64_t total_bytes,
                     int n_threads, int64_t thread_min_bytes) {
    int64_t t = n_threads < 1 ? 1 : n_threads > FB_MAX_THREADS ? FB_MAX_THREADS : n_threads;
    if (total_bytes < thread_min_bytes) t = 1;
    if (t > (units + grain - 1) / grain) t = (units + grain - 1) / grain;
    if (t < 1) t = 1;  /* callers pass units > 0; this also lets gcc see jobs[0] is set */
    fb_job jobs[FB_MAX_THREADS];
    pthread_t tids[FB_MAX_THREADS];
    int started[FB_MAX_THREADS];
    for (int64_t k = 0; k < t; k++) {
        jobs[k] = *proto;
        int64_t b = k * (units / t) + min64(k, units % t), e = (k + 1) * (units / t) + min64(k + 1, units % t);
        jobs[k].begin = b / grain * grain;
        jobs[k].end = k + 1 == t ? units : e / grain * grain;
    }
    for (int64_t k = 1; k < t; k++)
        started[k] = pthread_create(&tids[k], NULL, job_main, &jobs[k]) == 0;
    jobs[0].work(&jobs[0]);
    int rc = FB_OK;
    for (int64_t k = 1; k < t; k++) {
        if (!started[k]) { jobs[k].work(&jobs[k]); continue; }  /* no thread (ulimit): do its share here */
        if (pthread_join(tids[k], NULL) != 0) rc = FB_ETHREAD;
    }
    return rc;
}

int fb_gather(char *dst, const char *const *srcs, int64_t n_items, int64_t item_bytes,
              int n_threads, int64_t thread_min_bytes, int64_t stream_min_bytes) {
    if (n_items < 0 || item_bytes < 0) return FB_ESIZE;
    if (item_bytes > 0 && n_items > INT64_MAX / item_bytes) return FB_EOVERFLOW;
    int64_t total = n_items * item_bytes;
    if (total == 0) return FB_OK;
    if (!dst || !srcs) return FB_ENULL;
    for (int64_t i = 0; i < n_items; i++) {
        if (!srcs[i]) return FB_ENULL;
        if (overlaps(dst, total, srcs[i], item_bytes)) return FB_EOVERLAP;
    }
    fb_job proto = {.work = gather_range, .dst = dst, .srcs = srcs, .item_bytes = item_bytes,
                    .stream = total >= stream_min_bytes};
    return run_split(&proto, total, FB_GRAIN, total, n_threads, thread_min_bytes);
}

const char *fb_strerror(int code) {
    switch (code) {
    case FB_OK: return "ok";
    case FB_ENULL: return "NULL pointer where data is required";
    case FB_ESIZE: return "negative count, length or size";
    case FB_EOVERFLOW: return "batch size in bytes overflows int64";
    case FB_EOVERLAP: return "a source overlaps the destination";
    case FB_ETHREAD: return "pthread_join failed";
    case FB_EFRAME: return "not a JSON array of the given count";
    default: return "unknown fastbatch error";
    }
}

/* Result lines. Encoding a batch's results in one call of Python's C JSON encoder costs half of encoding them
 * one by one (a call's own cost is most of a small result's); this cuts that one text into the lines. */

static char *put_int(char *o, int64_t v) {
    char digits[20];
    int n = 0;
    uint64_t u = v < 0 ? 0 - (uint64_t)v : (uint64_t)v;
    do {
        digits[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) *o++ = '-';
    while (n) *o++ = digits[--n];
    return o;
}

int64_t fb_frame_lines(const char *array, int64_t len, int64_t first, int64_t count, char *out, int64_t cap) {
    static const char head[] = "{\"i\":", mid[] = ",\"ok\":true,\"result\":";
    if (!array || !out) return FB_ENULL;
    if (len < 2 || count < 0 || cap < 0) return FB_ESIZE;
    if (array[0] != '[' || array[len - 1] != ']') return FB_EFRAME;
    const char *p = array + 1, *end = array + len - 1;   /* the values lie in [array + 1, end) */
    char *o = out;
    int64_t k = 0;
    if (p == end) return count == 0 ? 0 : FB_EFRAME;
    for (;;) {
        const char *start = p;
        int64_t depth = 0;
        for (; p < end && !(depth == 0 && *p == ','); p++) {
            if (*p == '"') {
                for (p++; p < end && *p != '"'; p++)
                    if (*p == '\\') p++;               /* the escaped character, whatever it is */
                if (p >= end) return FB_EFRAME;        /* a string left open */
            } else if (*p == '[' || *p == '{') {
                depth++;
            } else if (*p == ']' || *p == '}') {
                depth--;
            }
        }
        if (depth != 0 || p == start || k == count) return FB_EFRAME;
        if (out + cap - o < (p - start) + FB_LINE_FRAME) return FB_ESIZE;
        memcpy(o, head, sizeof head - 1);
        o = put_int(o + sizeof head - 1, first + k);
        memcpy(o, mid, sizeof mid - 1);
        o += sizeof mid - 1;
        memcpy(o, start, (size_t)(p - start));
        o += p - start;
        *o++ = '}';
        *o++ = '\n';
        k++;
        if (p == end) break;
        p++;                                           /* past the comma */
    }
    return k == count ? o - out : FB_EFRAME;
}
