/* fastbatch.h — the C half of fastbatch: gather B rows into one contiguous batch with one copy;
 * and, for warmd, the JSONL frame of a batch's result lines (fb_frame_lines).
 *
 * Every buffer is allocated by the caller (Python: a pinned, reused ring slot or a torch tensor);
 * these functions only read the sources and write the destination. _build.py reads its cffi
 * declarations from this file, so keep it plain C declarations and #define constants.
 */
#ifndef FASTBATCH_H
#define FASTBATCH_H

#include <stdint.h>

/* Return codes: 0 is success, every failure is negative and named (fb_strerror gives the text). */
#define FB_OK         0
#define FB_ENULL     -1  /* a NULL pointer where bytes must be read or written */
#define FB_ESIZE     -2  /* a negative count, length or size */
#define FB_EOVERFLOW -4  /* n_items * row bytes does not fit in int64 */
#define FB_EOVERLAP  -5  /* a source overlaps the destination (memcpy would corrupt it) */
#define FB_ETHREAD   -6  /* pthread_join failed: a copy thread may not have finished */
#define FB_EFRAME    -7  /* fb_frame_lines: the text is not a JSON array of exactly `count` values */

/* The bytes fb_frame_lines adds to one result's text, at most: '{"i":', the index (an int64: 20 characters with
 * its sign), ',"ok":true,"result":', then '}' and the newline. */
#define FB_LINE_FRAME 47

/* dst[i * item_bytes : (i + 1) * item_bytes] = srcs[i][0 : item_bytes] for i in [0, n_items).
 * Split over up to n_threads pthreads when n_items * item_bytes >= thread_min_bytes; written with
 * non-temporal (cache-bypassing) stores when it is >= stream_min_bytes (x86; memcpy elsewhere). */
int fb_gather(char *dst, const char *const *srcs, int64_t n_items, int64_t item_bytes,
              int n_threads, int64_t thread_min_bytes, int64_t stream_min_bytes);

/* warmd's result lines: `array` is a batch's results encoded as one compact JSON array ("[r0,r1,...]", as
 * Python's C encoder writes it: ASCII only, no whitespace), and for each of its `count` values, k from 0, out gets
 * the line {"i":first+k,"ok":true,"result":rk} and a newline. Returns the bytes written (at most len + count *
 * FB_LINE_FRAME), or FB_ENULL, FB_ESIZE (out smaller than that), FB_EFRAME. A value's text is found by counting
 * brackets outside strings, and a string's end by its first quote that no backslash escapes. */
int64_t fb_frame_lines(const char *array, int64_t len, int64_t first, int64_t count, char *out, int64_t cap);

/* A short static description of a return code. */
const char *fb_strerror(int code);

#endif
