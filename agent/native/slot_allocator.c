/*
 * warmserve slot allocator: a PyTorch CUDAPluggableAllocator that serves allocations from the
 * KV-cache range of the active prewarm slot (WarmServe §4.2; vllm-integration note §0 step 3,
 * §7.3 option 5).
 *
 * The agent maps the slot's pages with the CUDA VMM API (weights at the start, KV cache after
 * them) before the engine starts, so this allocator never calls CUDA: it only hands out
 * addresses inside [base, base + size) of an already-mapped range.  That is why it compiles
 * without CUDA headers or a GPU.  Used as
 *
 *   alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "warmserve_malloc", "warmserve_free")
 *   pool = torch.cuda.MemPool(alloc.allocator())
 *   with torch.cuda.use_mem_pool(pool): kv = torch.zeros(n, dtype=torch.int8, device="cuda")
 *
 * First-fit over a sorted block list with coalescing on free; 256-byte alignment (what the CUDA
 * caching allocator guarantees).  One region per device; thread-safe.  During a grace period the
 * agent shrinks the region from its end (warmserve_shrink) before it unmaps the tail pages, and
 * the call fails if a live allocation still reaches into the tail.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>

#define WS_MAX_DEVICES 64
#define WS_MAX_BLOCKS 4096
#define WS_ALIGN 256u

typedef struct {
    uint64_t off, len;
    int used;
} ws_block;

typedef struct {
    uint64_t base, size;
    int nblocks;
    ws_block blocks[WS_MAX_BLOCKS];
} ws_region;

static ws_region regions[WS_MAX_DEVICES];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static int live(const ws_region *r) {
    int n = 0;
    for (int i = 0; i < r->nblocks; i++) n += r->blocks[i].used;
    return n;
}

/* Set (or replace) device's region. Refused (-1) while allocations from the old region live. */
int warmserve_set_region(int device, uint64_t base, uint64_t size) {
    if (device < 0 || device >= WS_MAX_DEVICES || base % WS_ALIGN) return -1;
    pthread_mutex_lock(&lock);
    ws_region *r = &regions[device];
    if (live(r)) {
        pthread_mutex_unlock(&lock);
        return -1;
    }
    r->base = base;
    r->size = size;
    r->nblocks = size ? 1 : 0;
    r->blocks[0] = (ws_block){0, size, 0};
    pthread_mutex_unlock(&lock);
    return 0;
}

void *warmserve_malloc(ssize_t size, int device, void *stream) {
    (void)stream;
    if (device < 0 || device >= WS_MAX_DEVICES || size <= 0) return NULL;
    uint64_t need = ((uint64_t)size + WS_ALIGN - 1) / WS_ALIGN * WS_ALIGN;
    void *out = NULL;
    pthread_mutex_lock(&lock);
    ws_region *r = &regions[device];
    for (int i = 0; i < r->nblocks; i++) {
        ws_block *b = &r->blocks[i];
        if (b->used || b->len < need) continue;
        if (b->len > need) {
            if (r->nblocks == WS_MAX_BLOCKS) break; /* cannot split: out of bookkeeping */
            memmove(&r->blocks[i + 2], &r->blocks[i + 1],
                    (size_t)(r->nblocks - i - 1) * sizeof(ws_block));
            r->blocks[i + 1] = (ws_block){b->off + need, b->len - need, 0};
            r->nblocks++;
            b->len = need;
        }
        b->used = 1;
        out = (void *)(uintptr_t)(r->base + b->off);
        break;
    }
    pthread_mutex_unlock(&lock);
    return out;
}

void warmserve_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)size;
    (void)stream;
    if (device < 0 || device >= WS_MAX_DEVICES || ptr == NULL) return;
    pthread_mutex_lock(&lock);
    ws_region *r = &regions[device];
    uint64_t off = (uint64_t)(uintptr_t)ptr - r->base;
    for (int i = 0; i < r->nblocks; i++) {
        if (r->blocks[i].off != off || !r->blocks[i].used) continue;
        r->blocks[i].used = 0;
        if (i + 1 < r->nblocks && !r->blocks[i + 1].used) { /* merge right */
            r->blocks[i].len += r->blocks[i + 1].len;
            memmove(&r->blocks[i + 1], &r->blocks[i + 2],
                    (size_t)(r->nblocks - i - 2) * sizeof(ws_block));
            r->nblocks--;
        }
        if (i > 0 && !r->blocks[i - 1].used) { /* merge left */
            r->blocks[i - 1].len += r->blocks[i].len;
            memmove(&r->blocks[i], &r->blocks[i + 1],
                    (size_t)(r->nblocks - i - 1) * sizeof(ws_block));
            r->nblocks--;
        }
        break;
    }
    pthread_mutex_unlock(&lock);
}

/* Shrink device's region to new_size bytes (grace-period lending). -1 if a live allocation
 * reaches past new_size; the caller must not unmap those pages. */
int warmserve_shrink(int device, uint64_t new_size) {
    if (device < 0 || device >= WS_MAX_DEVICES) return -1;
    int rc = 0;
    pthread_mutex_lock(&lock);
    ws_region *r = &regions[device];
    if (new_size > r->size) {
        rc = -1;
    } else {
        for (int i = 0; i < r->nblocks; i++)
            if (r->blocks[i].used && r->blocks[i].off + r->blocks[i].len > new_size) rc = -1;
        if (rc == 0) {
            int n = 0;
            for (int i = 0; i < r->nblocks; i++) {
                ws_block b = r->blocks[i];
                if (b.off >= new_size) break;
                if (b.off + b.len > new_size) b.len = new_size - b.off;
                r->blocks[n++] = b;
            }
            r->nblocks = n;
            r->size = new_size;
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

uint64_t warmserve_used(int device) {
    if (device < 0 || device >= WS_MAX_DEVICES) return 0;
    uint64_t n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < regions[device].nblocks; i++)
        if (regions[device].blocks[i].used) n += regions[device].blocks[i].len;
    pthread_mutex_unlock(&lock);
    return n;
}
