/* fastbatch.c — the one-copy batch gather behind fastbatch.stack and fastbatch.pad, and the result
 * lines' frame behind warmd.format_outcome (at the end).
 *
 * Python checks shapes and dtypes and allocates every buffer (usually a slot of a pinned ring
 * reused batch after batch); this file only moves bytes: B source rows into one contiguous
 * destination, padding ragged rows in the same pass, split over pthreads above a size threshold.
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
    int64_t item_bytes;       /* gather: bytes per source */
    const int64_t *lens;      /* pad: source lengths in elements */
    int64_t row_len;          /* pad: destination row length in elements */
    int elem_size;            /* pad: bytes per element */
    const void *pad_value;    /* pad: elem_size bytes */
    int stream;               /* write dst with non-temporal stores (see copy_bytes) */
    int64_t begin, end;       /* gather: byte range of dst; pad: row range */
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

/* count copies of the elem_size bytes at v. Streaming (x86): one 16-byte pattern register,
 * phase-shifted to the first aligned address (elem_size divides 16, so the phase repeats). Else
 * memset when all its bytes agree (0, -1: the usual pads), or one element then doubling memcpy,
 * which needs no alignment and is a dozen calls for a 16 KiB tail. */
static void fill(char *p, int64_t count, int elem_size, const void *v, int stream) {
    const unsigned char *b = v;
    int64_t total = count * elem_size;
    if (total <= 0) return;
#if defined(__SSE2__)
    if (stream && total >= 256) {
        int64_t head = (int64_t)(-(uintptr_t)p & 15), o = 0;
        unsigned char pat[16];
        for (int k = 0; k < 16; k++) pat[k] = b[(head + k) % elem_size];
        __m128i x = _mm_loadu_si128((const __m128i *)pat);
        for (; o < head; o++) p[o] = b[o % elem_size];
        for (; o + 16 <= total; o += 16) _mm_stream_si128((__m128i *)(p + o), x);
        for (; o < total; o++) p[o] = b[o % elem_size];
        return;
    }
#else
    (void)stream;
#endif
    int same = 1;
    for (int k = 1; k < elem_size; k++) same &= b[k] == b[0];
    if (same) { memset(p, b[0], (size_t)total); return; }
    memcpy(p, b, (size_t)elem_size);
    for (int64_t done = elem_size; done < total;) {
        int64_t k = min64(done, total - done);
        memcpy(p + done, p, (size_t)k);
        done += k;
    }
}

/* Rows [begin, end): the row's data, then the pad value to its end. */
static void pad_rows(const fb_job *j) {
    const int es = j->elem_size;
    const int64_t row_bytes = j->row_len * es;
    for (int64_t i = j->begin; i < j->end; i++) {
        char *row = j->dst + i * row_bytes;
        int64_t k = min64(j->lens[i], j->row_len);
        if (k > 0) copy_bytes(row, j->srcs[i], k * es, j->stream);
        fill(row + k * es, j->row_len - k, es, j->pad_value, j->stream);
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

int fb_pad_gather(char *dst, const char *const *srcs, const int64_t *lens, int64_t n_items,
                  int64_t row_len, int elem_size, const void *pad_value,
                  int n_threads, int64_t thread_min_bytes, int64_t stream_min_bytes) {
    if (n_items < 0 || row_len < 0) return FB_ESIZE;
    if (elem_size != 1 && elem_size != 2 && elem_size != 4 && elem_size != 8) return FB_EELEM;
    if (row_len > INT64_MAX / elem_size) return FB_EOVERFLOW;
    int64_t row_bytes = row_len * elem_size;
    if (row_bytes > 0 && n_items > INT64_MAX / row_bytes) return FB_EOVERFLOW;
    int64_t total = n_items * row_bytes;
    if (total == 0) return FB_OK;
    if (!dst || !srcs || !lens || !pad_value) return FB_ENULL;
    for (int64_t i = 0; i < n_items; i++) {
        if (lens[i] < 0) return FB_ESIZE;
        int64_t k = min64(lens[i], row_len) * elem_size;
        if (k > 0 && !srcs[i]) return FB_ENULL;
        if (overlaps(dst, total, srcs[i], k)) return FB_EOVERLAP;
    }
    fb_job proto = {.work = pad_rows, .dst = dst, .srcs = srcs, .lens = lens,
                    .row_len = row_len, .elem_size = elem_size, .pad_value = pad_value,
                    .stream = total >= stream_min_bytes};
    return run_split(&proto, n_items, 1, total, n_threads, thread_min_bytes);
}

const char *fb_strerror(int code) {
    switch (code) {
    case FB_OK: return "ok";
    case FB_ENULL: return "NULL pointer where data is required";
    case FB_ESIZE: return "negative count, length or size";
    case FB_EELEM: return "pad element size must be 1, 2, 4 or 8 bytes";
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
