/*
 * pool.c -- the slot pool: versioned ids over blocks that are never freed
 * while the core lives (docs/design.rst rule 1).
 *
 * A slot index names a block (index >> BT_BLOCK_SHIFT) and a place in it;
 * the core's tag above it (internal.h) makes the low word of an id.
 *
 * A slot's generation starts at the core's gen0 and goes up by one each time
 * the slot is freed, wrapping at 2^32.  When it would come back to gen0 the
 * slot is retired instead of freed: it is never handed out again, so no id of
 * the core ever repeats (rule 1).  That costs one 64-byte slot per 2^32
 * reuses of a slot.
 *
 * Blocks are published in the directory with a release store and looked up
 * with an acquire load, so bt_cancel can resolve any id without a lock.  Free
 * slots sit on per-bucket free lists under the bucket mutex; growing the pool
 * (mmap) happens outside every bucket lock.
 *
 * Blocks come straight from mmap, 64 KiB each, and go back to the system
 * whole when the core is destroyed.  From malloc they would land in its
 * heaps once its dynamic mmap threshold has risen (it does, the first time
 * a big heap array is freed), and a process that creates and destroys
 * TimerThreads saw its RSS creep up with the fragments: tests/soak.py, which
 * keeps replacing TimerThreads, grew by about 5 MB a minute that way while
 * malloc's bytes in use stayed flat.
 *
 * The first block comes ready: the timer thread maps it and faults its
 * pages in as it starts (bt__pool_make_spare), so that the first timer a
 * program schedules does not take the mmap and sixteen page faults (about
 * a third of its cost) on its own path.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "internal.h"

#define BT_BLOCK_BYTES (sizeof(struct bt_timer) * BT_BLOCK_SLOTS)

int bt__pool_init(bt_timer_thread *tt) {
    atomic_init(&tt->nblocks, 0);
    atomic_init(&tt->spare, NULL);
    for (uint32_t i = 0; i < BT_MAX_BLOCKS; i++) atomic_init(&tt->blocks[i], NULL);
    return pthread_mutex_init(&tt->pool_mutex, NULL) ? -ENOMEM : 0;
}

void bt__pool_destroy(bt_timer_thread *tt) {
    uint32_t n = atomic_load(&tt->nblocks);
    for (uint32_t i = 0; i < n; i++) munmap(atomic_load(&tt->blocks[i]), BT_BLOCK_BYTES);
    struct bt_timer *spare = atomic_load(&tt->spare);
    if (spare) munmap(spare, BT_BLOCK_BYTES);
    pthread_mutex_destroy(&tt->pool_mutex);
}

static struct bt_timer *map_block(int populate) {
    int flags = MAP_PRIVATE | MAP_ANONYMOUS;
#ifdef MAP_POPULATE
    if (populate) flags |= MAP_POPULATE; /* zeroed and mapped in one call */
#else
    (void)populate;
#endif
    void *p = mmap(NULL, BT_BLOCK_BYTES, PROT_READ | PROT_WRITE, flags, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

void bt__pool_make_spare(bt_timer_thread *tt) {
    if (atomic_load_explicit(&tt->nblocks, memory_order_relaxed)) return; /* too late */
    struct bt_timer *block = map_block(1);
    if (!block) return; /* the first grow maps its own */
    struct bt_timer *none = NULL;
    if (!atomic_compare_exchange_strong_explicit(&tt->spare, &none, block, memory_order_release,
                                                 memory_order_relaxed))
        munmap(block, BT_BLOCK_BYTES);
}

struct bt_timer *bt__slot(bt_timer_thread *tt, uint64_t id) {
    uint32_t low = (uint32_t)id;
    if (low >> BT_INDEX_BITS != tt->tag) return NULL; /* another core's, or none */
    uint32_t slot = low & BT_INDEX_MASK;
    uint32_t b = slot >> BT_BLOCK_SHIFT;
    if (b >= BT_MAX_BLOCKS) return NULL;
    struct bt_timer *block = atomic_load_explicit(&tt->blocks[b], memory_order_acquire);
    if (!block) return NULL;
    return &block[slot & (BT_BLOCK_SLOTS - 1)];
}

int bt__pool_grow(bt_timer_thread *tt, uint32_t b) {
    /* Allocate and initialise outside every lock.  mmap's pages are zeroed
     * and page-aligned (a slot is one cache line). */
    struct bt_timer *block = atomic_exchange_explicit(&tt->spare, NULL, memory_order_acquire);
    if (!block) block = map_block(0);
    if (!block) return -ENOMEM;

    pthread_mutex_lock(&tt->pool_mutex);
    uint32_t n = atomic_load_explicit(&tt->nblocks, memory_order_relaxed);
    if (n >= BT_MAX_BLOCKS) {
        pthread_mutex_unlock(&tt->pool_mutex);
        munmap(block, BT_BLOCK_BYTES);
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < BT_BLOCK_SLOTS; i++) {
        struct bt_timer *t = &block[i];
        atomic_init(&t->word, BT_WORD(tt->gen0, BT_S_FREE));
        t->slot = tt->tag << BT_INDEX_BITS | n << BT_BLOCK_SHIFT | i;
        t->bucket = b;
        t->next = (i + 1 < BT_BLOCK_SLOTS) ? &block[i + 1] : NULL;
    }
    /* Release: a reader that finds the block sees its initialised slots. */
    atomic_store_explicit(&tt->blocks[n], block, memory_order_release);
    atomic_store_explicit(&tt->nblocks, n + 1, memory_order_release);
    pthread_mutex_unlock(&tt->pool_mutex);

    bt__pool_free_chain(tt, b, &block[0], &block[BT_BLOCK_SLOTS - 1], BT_BLOCK_SLOTS);
    return 0;
}

void bt__pool_free_chain(bt_timer_thread *tt, uint32_t b, struct bt_timer *head,
                         struct bt_timer *tail, uint32_t n) {
    struct bt__bucket *bk = &tt->buckets[b];
    pthread_mutex_lock(&bk->mutex);
    tail->next = bk->free;
    bk->free = head;
    bk->nfree += n;
    pthread_mutex_unlock(&bk->mutex);
}

int bt__slot_retire(bt_timer_thread *tt, struct bt_timer *t) {
    uint64_t w = atomic_load_explicit(&t->word, memory_order_relaxed);
    uint32_t gen = BT_WORD_GEN(w) + 1; /* wraps through 0: the tag keeps ids nonzero */
    /* port/fn/arg are left as they are: the next schedule overwrites them,
     * and a racing bt_drop_all may still read them (its CAS then fails). */
    /* Relaxed: the slot reaches its next owner through a free list, under
     * the bucket mutex, which orders everything before this store ahead of
     * the next schedule; a stale id that reads FREE here reads nothing else
     * (docs/design.rst, "Memory orderings"). */
    atomic_store_explicit(&t->word, BT_WORD(gen, BT_S_FREE), memory_order_relaxed);
    if (__builtin_expect(gen != tt->gen0, 1)) return 1;
    /* All 2^32 generations used: the slot stays FREE (a stale id of it
     * answers BT_UNKNOWN) and is never handed out again. */
    atomic_fetch_add_explicit(&tt->slots_retired, 1, memory_order_relaxed);
    return 0;
}

int64_t bt_foreach_pending(bt_timer_thread *tt, bt_pending_fn fn, void *ctx) {
    if (!tt || !fn) return -EINVAL;
    if (bt__forked(tt)) return -ECHILD;
    int64_t n = 0;
    uint32_t nblocks = atomic_load_explicit(&tt->nblocks, memory_order_acquire);
    for (uint32_t bl = 0; bl < nblocks; bl++) {
        struct bt_timer *block = atomic_load_explicit(&tt->blocks[bl], memory_order_acquire);
        for (uint32_t i = 0; i < BT_BLOCK_SLOTS; i++) {
            struct bt_timer *t = &block[i];
            /* A seqlock's read: the word, the fields, the word again.  The
             * acquire load made this generation's fields visible; the fence
             * keeps the field reads before the second load, and a slot
             * that was freed or reused meanwhile shows another generation
             * or a state other than PENDING or POSTED. */
            uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);
            uint32_t st = BT_WORD_STATE(w);
            if (st != BT_S_PENDING && st != BT_S_POSTED) continue;
            bt_port *port = bt__port_of(t);
            void *arg = BT_LOAD(t->arg);
            int64_t deadline = bt__current_deadline(t, w);
            atomic_thread_fence(memory_order_acquire);
            uint64_t w2 = atomic_load_explicit(&t->word, memory_order_relaxed);
            uint32_t st2 = BT_WORD_STATE(w2);
            if (BT_WORD_GEN(w2) != BT_WORD_GEN(w) || (st2 != BT_S_PENDING && st2 != BT_S_POSTED))
                continue;
            n++;
            if (fn(ctx, port, arg, ((uint64_t)BT_WORD_GEN(w) << 32) | t->slot, deadline)) return n;
        }
    }
    return n;
}

int64_t bt__pool_cancel(bt_timer_thread *tt, const bt_port *port, bt_drop_fn on_drop, void *ctx) {
    int64_t n = 0;
    uint32_t nblocks = atomic_load_explicit(&tt->nblocks, memory_order_acquire);
    for (uint32_t bl = 0; bl < nblocks; bl++) {
        struct bt_timer *block = atomic_load_explicit(&tt->blocks[bl], memory_order_acquire);
        for (uint32_t i = 0; i < BT_BLOCK_SLOTS; i++) {
            struct bt_timer *t = &block[i];
            uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);
            for (;;) {
                uint32_t st = BT_WORD_STATE(w);
                if (st != BT_S_PENDING && st != BT_S_POSTED) break;
                /* Read before the CAS: once it succeeds the slot's owner may
                 * free and reuse it at once.  The acquire load of w made this
                 * generation's fields visible; if the slot moved on since,
                 * the CAS fails and the loop looks again. */
                bt_port *p = bt__port_of(t);
                void *arg = BT_LOAD(t->arg);
                if (port && p != port) break;
                if (atomic_compare_exchange_weak_explicit(
                        &t->word, &w, BT_WORD(BT_WORD_GEN(w), BT_S_CANCELLED),
                        memory_order_acq_rel, memory_order_acquire)) {
                    n++;
                    if (on_drop) on_drop(ctx, p, arg);
                    break;
                }
            }
        }
    }
    /* Counted as cancels (rule 10), in one add. */
    atomic_fetch_add_explicit(&tt->buckets[0].cancelled, (uint64_t)n, memory_order_relaxed);
    return n;
}
