/* fastbatch.h — the C half of fastbatch: gather B rows into one contiguous batch with one copy.
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
#define FB_EELEM     -3  /* pad element size is not 1, 2, 4 or 8 bytes */
#define FB_EOVERFLOW -4  /* n_items * row bytes does not fit in int64 */
#define FB_EOVERLAP  -5  /* a source overlaps the destination (memcpy would corrupt it) */
#define FB_ETHREAD   -6  /* pthread_join failed: a copy thread may not have finished */

/* dst[i * item_bytes : (i + 1) * item_bytes] = srcs[i][0 : item_bytes] for i in [0, n_items).
 * Split over up to n_threads pthreads when n_items * item_bytes >= thread_min_bytes; written with
 * non-temporal (cache-bypassing) stores when it is >= stream_min_bytes (x86; memcpy elsewhere). */
int fb_gather(char *dst, const char *const *srcs, int64_t n_items, int64_t item_bytes,
              int n_threads, int64_t thread_min_bytes, int64_t stream_min_bytes);

/* Row i of the [n_items, row_len] destination gets k = min(lens[i], row_len) elements of srcs[i]
 * followed by row_len - k copies of the elem_size bytes at pad_value (the pad value already
 * encoded in the destination dtype, so float32/float64/int pads are all just bytes here).
 * Threads and streaming stores as fb_gather, by the destination's size in bytes. */
int fb_pad_gather(char *dst, const char *const *srcs, const int64_t *lens, int64_t n_items,
                  int64_t row_len, int elem_size, const void *pad_value,
                  int n_threads, int64_t thread_min_bytes, int64_t stream_min_bytes);

/* A short static description of a return code. */
const char *fb_strerror(int code);

#endif
