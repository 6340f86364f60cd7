/* Rows of a checkpoint tensor read from its file by pread, one call for a step's ids
 * (models/loaders/file_rows.py says why rows are read rather than mapped; this is its
 * loop in C: at 64 rows a step the Python loop's 64 calls cost about a third of a
 * millisecond, most of it the interpreter around each pread). */

#include <errno.h>
#include <stdint.h>
#include <unistd.h>

/* Row ids[i] of the [num_rows, row_bytes] table at byte `offset` of the file `fd` into
 * out + i * row_bytes, for i < n. Returns -1 when every row was read; else the index i of
 * the first id out of range (nothing read for it or after it), or n + i where row i could
 * not be read whole (the file ended inside it, or pread failed). */
int64_t read_rows(int32_t fd, int64_t offset, int64_t row_bytes, int64_t num_rows, const int64_t *ids, int64_t n,
                  char *out) {
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= num_rows) return i;
        int64_t done = 0;
        while (done < row_bytes) {
            const ssize_t got = pread(fd, out + i * row_bytes + done, (size_t)(row_bytes - done),
                                      (off_t)(offset + ids[i] * row_bytes + done));
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) return n + i;
            done += got;
        }
    }
    return -1;
}
