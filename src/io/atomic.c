/* ============================================================================
 * The atomic file writer shared by weights (safetensors), checkpoints and logs: bytes go to
 * "<path>.tmp.<pid>.<n>" in the same folder through a buffer; commit syncs the file, renames
 * it over `path` and syncs the folder (POSIX), so a reader sees the old file or the whole new
 * one, and a crash leaves no half-written `path`. Any failure removes the temporary file.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"
#include <errno.h>
#include <sys/stat.h>
#ifdef _WIN32
#include <io.h>
#include <process.h>
#include <windows.h>
#else
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>
#endif

struct dtr__afile {
    char *path, *tmp;
#ifdef _WIN32
    FILE *fp;
#else
    int fd;
#endif
    int failed;        /* errno of the first failed write, -1 for a short write, 0: none */
    size_t used;
    char buf[8192];
};

static unsigned dtr__afile_serial;   /* distinguishes temporary files of one process */

int dtr__not_regular_file(const char *path) {
#ifdef _WIN32
    struct _stat64 st;
    return _stat64(path, &st) == 0 && (st.st_mode & _S_IFMT) != _S_IFREG;
#else
    struct stat st;
    return stat(path, &st) == 0 && !S_ISREG(st.st_mode);
#endif
}

#ifndef _WIN32
/* A path that exists and is not a regular file (a folder, FIFO, device) is not replaced. */
static dtr_result dtr__afile_check_target(const char *path, char *err, size_t errlen) {
    struct stat st;
    if (stat(path, &st) != 0 || S_ISREG(st.st_mode)) return DTR_OK;
    return dtr__errf(err, errlen, DTR_INVALID_ARGUMENT, "%s: exists and is not a regular file (%s): refusing to replace it",
                     path, S_ISDIR(st.st_mode) ? "a folder" : S_ISFIFO(st.st_mode) ? "a FIFO" : "a device or socket");
}

/* Removes "<base>.tmp.<pid>.<n>" files beside `path` whose process is gone: saves killed
 * midway leave them, and each would otherwise stay forever. */
static void dtr__afile_sweep(const char *path) {
    char dir[4096], victim[4096 + 256];
    const char *slash = strrchr(path, '/'), *base = slash ? slash + 1 : path;
    size_t bl = strlen(base), dl = slash ? (size_t)(slash - path) : 0;
    struct dirent *d;
    DIR *dp;
    if (dl >= sizeof dir || bl == 0) return;
    if (slash) { memcpy(dir, path, dl ? dl : 1); dir[dl ? dl : 1] = '\0'; }
    else strcpy(dir, ".");
    if (!(dp = opendir(dir))) return;
    while ((d = readdir(dp)) != NULL) {
        long long pid = 0;
        unsigned n;
        char tail;
        if (strncmp(d->d_name, base, bl) != 0 || strncmp(d->d_name + bl, ".tmp.", 5) != 0) continue;
        if (sscanf(d->d_name + bl + 5, "%lld.%u%c", &pid, &n, &tail) != 2 || pid == (long long)getpid()) continue;
        if (!dtr__pid_dead((int64_t)pid)) continue;
        snprintf(victim, sizeof victim, "%s/%s", dir, d->d_name);
        (void)remove(victim);
    }
    closedir(dp);
}
#endif

dtr_result dtr__afile_open(dtr__afile **out, const char *path, char *err, size_t errlen) {
    dtr__afile *f;
    long pid;
    *out = NULL;
    if (!path) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "atomic write: path is NULL");
    f = (dtr__afile *)dtr__calloc(NULL, sizeof *f);
    if (f) f->tmp = (char *)dtr__malloc(NULL, strlen(path) + 48);
    if (f) f->path = (char *)dtr__malloc(NULL, strlen(path) + 1);
    if (!f || !f->tmp || !f->path) {
        if (f) { dtr__free(NULL, f->tmp); dtr__free(NULL, f->path); dtr__free(NULL, f); }
        return dtr__errf(err, errlen, DTR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    strcpy(f->path, path);
#ifdef _WIN32
    pid = (long)_getpid();
    sprintf(f->tmp, "%s.tmp.%ld.%u", path, pid, DTR__ATOMIC_INC(&dtr__afile_serial));
    f->fp = fopen(f->tmp, "wb");
    if (!f->fp) {
#else
    {
        dtr_result r = dtr__afile_check_target(path, err, errlen);
        if (r != DTR_OK) { dtr__free(NULL, f->tmp); dtr__free(NULL, f->path); dtr__free(NULL, f); return r; }
    }
    dtr__afile_sweep(path);
    pid = (long)getpid();
    sprintf(f->tmp, "%s.tmp.%ld.%u", path, pid, DTR__ATOMIC_INC(&dtr__afile_serial));
    do { f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC, 0666); } while (f->fd < 0 && errno == EINTR);
    if (f->fd < 0) {
#endif
        dtr_result r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: cannot create temporary file %s: %s", path, f->tmp,
                                 strerror(errno));
        dtr__free(NULL, f->tmp);
        dtr__free(NULL, f->path);
        dtr__free(NULL, f);
        return r;
    }
    *out = f;
    return DTR_OK;
}

static void dtr__afile_raw(dtr__afile *f, const char *c, size_t n) {
    while (n > 0 && !f->failed) {
        size_t chunk = n < ((size_t)1 << 30) ? n : ((size_t)1 << 30);
#ifdef _WIN32
        if (fwrite(c, 1, chunk, f->fp) != chunk) { f->failed = errno ? errno : -1; return; }
#else
        ssize_t w = write(f->fd, c, chunk);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) { f->failed = w < 0 && errno ? errno : -1; return; }
        chunk = (size_t)w;
#endif
        c += chunk;
        n -= chunk;
    }
}

void dtr__afile_write(dtr__afile *f, const void *p, size_t n) {
    if (f->used + n > sizeof f->buf) {
        dtr__afile_raw(f, f->buf, f->used);
        f->used = 0;
        if (n >= sizeof f->buf) { dtr__afile_raw(f, (const char *)p, n); return; }
    }
    memcpy(f->buf + f->used, p, n);
    f->used += n;
}

static void dtr__afile_free(dtr__afile *f, int remove_tmp) {
    if (remove_tmp) remove(f->tmp);
    dtr__free(NULL, f->tmp);
    dtr__free(NULL, f->path);
    dtr__free(NULL, f);
}

void dtr__afile_abort(dtr__afile *f) {
    if (!f) return;
#ifdef _WIN32
    fclose(f->fp);
#else
    close(f->fd);
#endif
    dtr__afile_free(f, 1);
}

/* Syncs and closes the temporary file; 0 or the errno of the failure. */
static int dtr__afile_close(dtr__afile *f) {
    int e = 0;
#ifdef _WIN32
    if (fflush(f->fp) != 0 || _commit(_fileno(f->fp)) != 0) e = errno;
    if (fclose(f->fp) != 0 && !e) e = errno;
#else
    if (fsync(f->fd) != 0) e = errno;
    if (close(f->fd) != 0 && !e) e = errno;
#endif
    return e;
}

/* The rename made durable: the folder holding `path` is synced (best effort). */
static void dtr__afile_sync_dir(const char *path) {
#ifndef _WIN32
    char dir[4096];
    const char *slash = strrchr(path, '/');
    size_t dl = slash ? (size_t)(slash - path) : 0;
    int dfd;
    if (dl >= sizeof dir) return;
    if (slash) { memcpy(dir, path, dl ? dl : 1); dir[dl ? dl : 1] = '\0'; }
    else strcpy(dir, ".");
    dfd = open(dir, O_RDONLY);
    if (dfd >= 0) { (void)fsync(dfd); close(dfd); }
#else
    (void)path;
#endif
}

dtr_result dtr__afile_commit(dtr__afile *f, char *err, size_t errlen) {
    dtr_result r = DTR_OK;
    int e;
    dtr__afile_raw(f, f->buf, f->used);
    f->used = 0;
    if (f->failed) {
        r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: write to %s failed: %s", f->path, f->tmp,
                      f->failed > 0 ? strerror(f->failed) : "short write");
        dtr__afile_abort(f);
        return r;
    }
    if ((e = dtr__afile_close(f)) != 0) {
        r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: syncing %s failed: %s", f->path, f->tmp, strerror(e));
        dtr__afile_free(f, 1);
        return r;
    }
#ifdef _WIN32
    if (!MoveFileExA(f->tmp, f->path, MOVEFILE_REPLACE_EXISTING | MOVEFILE_WRITE_THROUGH)) {
        r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: renaming %s into place failed (error %lu)", f->path, f->tmp,
                      (unsigned long)GetLastError());
#else
    if (rename(f->tmp, f->path) != 0) {
        r = dtr__errf(err, errlen, DTR_IO_ERROR, "%s: renaming %s into place failed: %s", f->path, f->tmp, strerror(errno));
#endif
        dtr__afile_free(f, 1);
        return r;
    }
    dtr__afile_sync_dir(f->path);
    dtr__afile_free(f, 0);
    return DTR_OK;
}

dtr_result dtr_write_file_atomic(const char *path, const void *data, size_t bytes, char *err, size_t errlen) {
    dtr__afile *f;
    dtr_result r;
    if (err && errlen) err[0] = '\0';
    if (!data && bytes) return dtr__errf(err, errlen, DTR_NULL_HANDLE, "dtr_write_file_atomic: data is NULL");
    if ((r = dtr__afile_open(&f, path, err, errlen)) != DTR_OK) return r;
    dtr__afile_write(f, data, bytes);
    return dtr__afile_commit(f, err, errlen);
}
