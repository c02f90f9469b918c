/*
 * lifecycle.c -- a core's life: options, creation (its id tag and first
 * generation), fork, stop, drop and destroy (docs/design.rst, rules 1
 * and 11).
 *
 * The tags in use and the fork generation are process-wide atomics.  bt_stop
 * sets the stop flag under wake_mutex, fences every bucket mutex, and joins
 * under stop_mutex; bt_drop_all CASes each slot's state word and takes no
 * lock; nothing here runs on a core inherited through fork().
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>

#include "internal.h"

/* ---- fork (rule 11) -------------------------------------------------------
 * A child of fork() has none of the parent's threads.  Every core remembers
 * the fork generation it was created in; a core from an earlier generation
 * refuses all work without touching its locks (another thread may have held
 * them at the fork). */

_Atomic uint64_t bt__fork_generation;
#ifdef BT_FAULT_INJECTION
_Atomic int bt__faults[BT_FAULT_POINTS];
#endif
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void on_fork_child(void) { atomic_fetch_add(&bt__fork_generation, 1); }
static void install_atfork(void) { pthread_atfork(NULL, NULL, on_fork_child); }


/* ---- ids (rule 1) ----------------------------------------------------------
 * An id is `generation << 32 | tag << 26 | index`.  The tag names the core:
 * tags 1..63 are handed out round robin among the tags no live core holds,
 * so up to 63 cores alive at once have distinct tags and bt_cancel answers
 * BT_UNKNOWN for another live core's ids without looking at a slot.  A
 * freed tag goes back to the end of the line.  Past 63 live cores tags are
 * shared; every core then still starts its slots' generations at its own
 * random gen0, so another core's id names a live timer only if both its
 * index and its 32-bit generation happen to match. */

static _Atomic uint64_t tags_in_use; /* bit t: tag t is some live core's own */
static _Atomic uint32_t tag_cursor;

static void take_tag(bt_timer_thread *tt) {
    uint32_t start = atomic_fetch_add_explicit(&tag_cursor, 1, memory_order_relaxed);
    for (uint32_t k = 0; k < BT_TAGS; k++) {
        uint32_t tag = 1 + (start + k) % BT_TAGS;
        uint64_t bit = 1ULL << tag;
        if (!(atomic_fetch_or(&tags_in_use, bit) & bit)) {
            tt->tag = tag;
            tt->tag_owned = 1;
            return;
        }
    }
    tt->tag = 1 + start % BT_TAGS;
    tt->tag_owned = 0;
}

static void give_tag(bt_timer_thread *tt) {
    if (tt->tag_owned) atomic_fetch_and(&tags_in_use, ~(1ULL << tt->tag));
}

static uint32_t random_gen0(const bt_timer_thread *tt) {
    uint32_t r;
    if (getrandom(&r, sizeof(r), GRND_NONBLOCK) == (ssize_t)sizeof(r)) return r;
    /* No entropy yet (early boot): a mix of the clock and the address. */
    uint64_t x = (uint64_t)bt_now_ns() ^ ((uint64_t)(uintptr_t)tt << 16);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (uint32_t)x;
}

/* ---- options and creation ------------------------------------------------ */

void bt_options_init(bt_options *opt) {
    memset(opt, 0, sizeof(*opt));
    opt->num_buckets = BT_DEFAULT_BUCKETS;
    opt->drain_threshold = BT_DEFAULT_DRAIN_THRESHOLD;
    opt->sweep_min = BT_DEFAULT_SWEEP_MIN;
}

/* opt_in with every zero field at its default; -EINVAL if out of range. */
static int normalized(const bt_options *opt_in, bt_options *opt) {
    bt_options_init(opt);
    if (opt_in) {
        *opt = *opt_in;
        if (!opt->num_buckets) opt->num_buckets = BT_DEFAULT_BUCKETS;
        if (!opt->drain_threshold) opt->drain_threshold = BT_DEFAULT_DRAIN_THRESHOLD;
        if (!opt->sweep_min) opt->sweep_min = BT_DEFAULT_SWEEP_MIN;
    }
    return opt->num_buckets > BT_MAX_BUCKETS ? -EINVAL : 0;
}

/* The core's memory, zeroed: the struct (half a megabyte, the slot
 * directory, mmapped like the slot blocks; pool.c says why not malloc),
 * its buckets and reap chains.  NULL if out of memory.  release() gives it
 * back. */
static bt_timer_thread *allocate(uint32_t nbuckets) {
    bt_timer_thread *tt =
        mmap(NULL, sizeof(*tt), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (tt == MAP_FAILED) return NULL;
    size_t size = sizeof(struct bt__bucket) * nbuckets;
    if (posix_memalign((void **)&tt->buckets, 64, size) == 0) {
        memset(tt->buckets, 0, size);
        tt->chains = calloc(nbuckets, sizeof(struct reap_chain));
        if (tt->chains) return tt;
        free(tt->buckets);
    }
    munmap(tt, sizeof(*tt));
    return NULL;
}

static void release(bt_timer_thread *tt) {
    free(tt->chains);
    free(tt->buckets);
    munmap(tt, sizeof(*tt));
}

/* 0, or the pool's error with nothing taken yet (the caller releases the
 * memory): the pool comes first, so a failure leaves no tag or lock. */
static int init_state(bt_timer_thread *tt, const bt_options *opt) {
    int rc = -bt__fault(BT_FAULT_POOL_INIT);
    if (!rc) rc = bt__pool_init(tt);
    if (rc) return rc;
    tt->opt = *opt;
    tt->nbuckets = opt->num_buckets;
    tt->fork_generation = atomic_load(&bt__fork_generation);
    tt->gen0 = random_gen0(tt);
    take_tag(tt);
    for (uint32_t b = 0; b < tt->nbuckets; b++) {
        pthread_mutex_init(&tt->buckets[b].mutex, NULL);
        tt->buckets[b].nearest = BT_NEVER;
        tt->buckets[b].prune_at = bt__prune_at(tt, 0);
    }
    pthread_mutex_init(&tt->wake_mutex, NULL);
    pthread_mutex_init(&tt->pass_mutex, NULL);
    pthread_mutex_init(&tt->ports_mutex, NULL);
    pthread_mutex_init(&tt->stop_mutex, NULL);
    tt->nearest = BT_NEVER;
    atomic_init(&tt->floor, BT_NEVER);
    tt->sweep_cursor = SIZE_MAX;
    atomic_init(&tt->manual_now, opt->manual_start_ns);
    return 0;
}

/* The timer thread runs with every signal blocked: signals are the
 * interpreter's business, on its own threads. */
static int start_thread(bt_timer_thread *tt) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = -pthread_create(&tt->thread, NULL, bt__timer_thread_main, tt);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc == 0) tt->started = 1;
    return rc;
}

int bt_create(const bt_options *opt_in, bt_timer_thread **out) {
    if (!out) return -EINVAL;
    *out = NULL;
    bt_options opt;
    if (normalized(opt_in, &opt)) return -EINVAL;
    pthread_once(&atfork_once, install_atfork);
    bt_timer_thread *tt = allocate(opt.num_buckets);
    if (!tt) return -ENOMEM;
    int rc = init_state(tt, &opt);
    if (rc) {
        release(tt);
        return rc;
    }
    rc = bt_port_open(tt, !opt.manual_clock, &tt->orphans);
    if (rc == 0 && !opt.manual_clock) rc = start_thread(tt);
    if (rc) {
        bt_destroy(tt);
        return rc;
    }
    *out = tt;
    return 0;
}

int32_t bt_is_stopped(bt_timer_thread *tt) {
    return !tt || bt__forked(tt) || atomic_load_explicit(&tt->stop, memory_order_acquire);
}

/* ---- stop, drop, destroy (rule 11) ----------------------------------------
 * bt_stop sets the flag, fences the buckets and joins the thread (manual
 * clock: waits out an advance in progress), one caller at a time under
 * stop_mutex: every caller returns only once the thread is joined.  A
 * caller inside a pass of the core -- a native callback of it, or of
 * another core whose pass runs inside one of its callbacks: the thread
 * keeps a stack of them (internal.h) -- runs on the thread itself, or holds
 * the pass lock further down its own stack, and cannot wait for either:
 * bt_stop from there sets the flag, fences the buckets and returns; the
 * pass stops after that callback, the thread leaves its loop, and the next
 * bt_stop from any other thread (bt_destroy's included) joins it.  A join
 * that fails leaves the thread counted as running: bt_stop reports it, and
 * bt_destroy refuses to free a core whose thread may still run.
 * bt_destroy from inside a pass cannot free what the pass still uses: it
 * stops the core and leaves the freeing to the thread (or to bt_advance)
 * once the callback has returned. */

/* A schedule in flight either saw the stop flag or has published its timer
 * once we hold its bucket's lock. */
static void fence_buckets(bt_timer_thread *tt) {
    for (uint32_t b = 0; b < tt->nbuckets; b++) {
        pthread_mutex_lock(&tt->buckets[b].mutex);
        pthread_mutex_unlock(&tt->buckets[b].mutex);
    }
}

/* Under stop_mutex, the core stopped (and its thread woken): joins it.
 * 0, or the join's error with the thread still counted as running. */
static int join_thread(bt_timer_thread *tt) {
    int e = bt__fault(BT_FAULT_JOIN);
    if (!e) e = pthread_join(tt->thread, NULL);
    if (e) return -e;
    tt->started = 0;
    return 0;
}

/* The core stopped: a pass in progress on another thread (a consumer's
 * bt_deliver_due, a bt_advance) has returned once we get its lock, and none
 * starts after (timer_thread.c). */
static void wait_out_passes(bt_timer_thread *tt) {
    pthread_mutex_lock(&tt->pass_mutex);
    pthread_mutex_unlock(&tt->pass_mutex);
}

int bt_stop(bt_timer_thread *tt) {
    if (!tt) return -EINVAL;
    if (bt__forked(tt)) return 0;
    bt__wake_to_stop(tt);
    if (bt__in_pass_of(tt)) { /* a callback, at any depth, of this core's pass */
        fence_buckets(tt);
        return 0;
    }
    pthread_mutex_lock(&tt->stop_mutex);
    fence_buckets(tt);
    int rc = 0;
    if (tt->started) rc = join_thread(tt);
    pthread_mutex_unlock(&tt->stop_mutex);
    if (rc == 0) wait_out_passes(tt);
    return rc;
}

int64_t bt_drop_all(bt_timer_thread *tt, bt_drop_fn on_drop, void *ctx) {
    if (!tt) return -EINVAL;
    if (bt__forked(tt)) return 0;
    if (!atomic_load(&tt->stop)) return -EBUSY;
    /* Every slot of every port: PENDING ones sit in lists or the heap,
     * POSTED ones in ports; both become CANCELLED, and their owners bt__reap
     * them as usual. */
    return bt__pool_cancel(tt, NULL, on_drop, ctx);
}

/* Frees everything; the thread, if any, is joined or is the caller. */
void bt__destroy_now(bt_timer_thread *tt) {
    bt_port *p = tt->ports;
    while (p) {
        bt_port *next = p->all_next;
        bt__port_free(p);
        p = next;
    }
    bt__reclaim_ports(tt);
    bt__heap_free(&tt->heap);
    bt__pool_destroy(tt);
    for (uint32_t b = 0; b < tt->nbuckets; b++) pthread_mutex_destroy(&tt->buckets[b].mutex);
    pthread_mutex_destroy(&tt->wake_mutex);
    pthread_mutex_destroy(&tt->pass_mutex);
    pthread_mutex_destroy(&tt->ports_mutex);
    pthread_mutex_destroy(&tt->stop_mutex);
    give_tag(tt);
    release(tt);
}

int bt_destroy(bt_timer_thread *tt) {
    if (!tt) return -EINVAL;
    if (bt__forked(tt)) return 0; /* its locks may be held by threads that are gone */
    int rc = bt_stop(tt);
    if (rc) return rc; /* its thread may still run: never free under it */
    if (bt__in_pass_of(tt)) { /* a callback: the pass still uses tt */
        tt->destroy_later = 1;
        return 0;
    }
    bt__destroy_now(tt);
    return 0;
}

