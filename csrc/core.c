/*
 * core.c -- scheduling, cancelling, the timer thread's pass, lifecycle and
 * counters.  docs/design.rst ("The rules, and what each costs") names the
 * rules; comments below say where each one is kept.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "internal.h"

/* ---- clock (rule 6) ------------------------------------------------------ */

int64_t bt_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t bt_time_ns(bt_timer_thread *tt) {
    if (tt && tt->opt.manual_clock)
        return atomic_load_explicit(&tt->manual_now, memory_order_acquire);
    return bt_now_ns();
}

/* ---- fork (rule 11) -------------------------------------------------------
 * A child of fork() has none of the parent's threads.  Every core remembers
 * the fork generation it was created in; a core from an earlier generation
 * refuses all work without touching its locks (another thread may have held
 * them at the fork). */

static _Atomic uint64_t fork_generation;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void on_fork_child(void) { atomic_fetch_add(&fork_generation, 1); }
static void install_atfork(void) { pthread_atfork(NULL, NULL, on_fork_child); }

static inline int forked(const bt_timer_thread *tt) {
    return tt->fork_generation != atomic_load_explicit(&fork_generation, memory_order_relaxed);
}

int bt__forked(const bt_timer_thread *tt) { return forked(tt); }

/* ---- the calling thread's bucket (rule 3) --------------------------------
 * Thread-local, assigned round robin on first use: timers of one thread stay
 * together, and two threads rarely share a lock.
 *
 * The index uses the initial-exec TLS model: in a shared object the default
 * model calls __tls_get_addr on every access, twice per schedule+cancel
 * pair; initial-exec reads it at a fixed offset from the thread pointer
 * (glibc keeps static TLS room for dlopen()ed objects' few bytes). */

#if defined(__GNUC__) || defined(__clang__)
#define BT_TLS_IE __attribute__((tls_model("initial-exec")))
#else
#define BT_TLS_IE
#endif

static _Atomic uint32_t next_thread_index;
static _Thread_local uint32_t thread_index_plus_one BT_TLS_IE;

/* The core whose pass this thread is running (its timer thread, or a
 * bt_advance), if any: what a native callback that stops or destroys its own
 * core needs to know (see "stop, drop, destroy"). */
static _Thread_local bt_timer_thread *pass_owner BT_TLS_IE;

static inline uint32_t bucket_of_caller(const bt_timer_thread *tt) {
    uint32_t i = thread_index_plus_one;
    if (__builtin_expect(i == 0, 0)) {
        i = atomic_fetch_add_explicit(&next_thread_index, 1, memory_order_relaxed) + 1;
        thread_index_plus_one = i;
    }
    uint32_t k = i - 1;
    return k < tt->nbuckets ? k : k % tt->nbuckets; /* no division for the first threads */
}

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

static void *timer_thread_main(void *arg);

int bt_create(const bt_options *opt_in, bt_timer_thread **out) {
    if (!out) return -EINVAL;
    *out = NULL;
    bt_options opt;
    bt_options_init(&opt);
    if (opt_in) {
        opt = *opt_in;
        if (!opt.num_buckets) opt.num_buckets = BT_DEFAULT_BUCKETS;
        if (!opt.drain_threshold) opt.drain_threshold = BT_DEFAULT_DRAIN_THRESHOLD;
        if (!opt.sweep_min) opt.sweep_min = BT_DEFAULT_SWEEP_MIN;
    }
    if (opt.num_buckets > BT_MAX_BUCKETS) return -EINVAL;
    pthread_once(&atfork_once, install_atfork);

    /* The core is half a megabyte (the slot directory), mmapped like the
     * slot blocks (pool.c says why not malloc); its pages come zeroed. */
    bt_timer_thread *tt =
        mmap(NULL, sizeof(*tt), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (tt == MAP_FAILED) return -ENOMEM;
    tt->opt = opt;
    tt->nbuckets = opt.num_buckets;
    tt->fork_generation = atomic_load(&fork_generation);
    tt->gen0 = random_gen0(tt);
    if (posix_memalign((void **)&tt->buckets, 64, sizeof(struct bt__bucket) * tt->nbuckets)) {
        munmap(tt, sizeof(*tt));
        return -ENOMEM;
    }
    memset(tt->buckets, 0, sizeof(struct bt__bucket) * tt->nbuckets);
    tt->chains = calloc(tt->nbuckets, sizeof(struct reap_chain));
    if (!tt->chains) {
        free(tt->buckets);
        munmap(tt, sizeof(*tt));
        return -ENOMEM;
    }
    take_tag(tt);
    for (uint32_t b = 0; b < tt->nbuckets; b++) {
        pthread_mutex_init(&tt->buckets[b].mutex, NULL);
        tt->buckets[b].nearest = BT_NEVER;
        tt->buckets[b].prune_at = 2 * opt.drain_threshold;
    }
    bt__pool_init(tt);
    pthread_mutex_init(&tt->wake_mutex, NULL);
    pthread_mutex_init(&tt->advance_mutex, NULL);
    pthread_mutex_init(&tt->ports_mutex, NULL);
    pthread_mutex_init(&tt->stop_mutex, NULL);
    tt->nearest = BT_NEVER;
    tt->sweep_cursor = SIZE_MAX;
    atomic_init(&tt->manual_now, opt.manual_start_ns);

    int rc = bt_port_open(tt, !opt.manual_clock, &tt->orphans);
    if (rc) goto fail;
    if (!opt.manual_clock) {
        /* The timer thread runs with every signal blocked: signals are the
         * interpreter's business, on its own threads. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        rc = -pthread_create(&tt->thread, NULL, timer_thread_main, tt);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (rc) goto fail;
        tt->started = 1;
    }
    *out = tt;
    return 0;
fail:
    tt->started = 0;
    bt_destroy(tt);
    return rc;
}

int32_t bt_is_stopped(bt_timer_thread *tt) {
    return !tt || forked(tt) || atomic_load_explicit(&tt->stop, memory_order_acquire);
}

/* ---- scheduling ------------------------------------------------------------ */

static void request_collect(bt_timer_thread *tt);

/* Under the bucket mutex: unlinks the cancelled entries of the bucket's list
 * and puts their slots straight on its free list.  Runs only when the list
 * reached prune_at, which then moves to twice what is left, so the work is
 * amortised O(1) per schedule and the list stays within
 * max(2 * drain_threshold, 2 * live) even when the timer thread lags. */
static void prune_locked(bt_timer_thread *tt, struct bt__bucket *bk) {
    struct bt_timer **link = &bk->head;
    uint32_t kept = 0, removed = 0;
    while (*link) {
        struct bt_timer *t = *link;
        uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);
        if (BT_WORD_STATE(w) == BT_S_CANCELLED) {
            *link = t->next;
            if (bt__slot_retire(tt, t)) {
                t->next = bk->free;
                bk->free = t;
                bk->nfree++;
            }
            removed++;
        } else {
            link = &t->next;
            kept++;
        }
    }
    bk->length = kept;
    bk->reaped += removed;
    uint32_t floor = 2 * tt->opt.drain_threshold;
    bk->prune_at = 2 * kept > floor ? 2 * kept : floor;
}

static int schedule(bt_timer_thread *tt, int64_t deadline, bt_port *port, bt_native_fn fn,
                    void *arg, uint64_t *out_id) {
    if (!tt || !out_id) return -EINVAL;
    if (forked(tt)) return -ECHILD;
    uint32_t b = bucket_of_caller(tt);
    struct bt__bucket *bk = &tt->buckets[b];
    uint64_t seq = atomic_fetch_add_explicit(&tt->seq, 1, memory_order_relaxed);

    pthread_mutex_lock(&bk->mutex);
    for (;;) {
        /* Checked under the bucket lock: bt_stop sets the flag and then
         * takes every bucket lock once, so a schedule either sees the flag
         * or publishes its timer before bt_stop returns (and bt_drop_all
         * finds it). */
        if (atomic_load_explicit(&tt->stop, memory_order_relaxed)) {
            pthread_mutex_unlock(&bk->mutex);
            return -ESHUTDOWN;
        }
        if (bk->free) break;
        /* Allocation happens outside the bucket lock (rule 3). */
        pthread_mutex_unlock(&bk->mutex);
        int rc = bt__pool_grow(tt, b);
        if (rc) return rc;
        pthread_mutex_lock(&bk->mutex);
    }
    struct bt_timer *t = bk->free;
    bk->free = t->next;
    bk->nfree--;
    t->deadline = deadline;
    t->seq = seq;
    BT_STORE(t->port, port);
    t->fn = fn;
    BT_STORE(t->arg, arg);
    uint64_t w = atomic_load_explicit(&t->word, memory_order_relaxed);
    uint32_t gen = BT_WORD_GEN(w);
    /* Release: whoever acquires this word sees the fields above. */
    atomic_store_explicit(&t->word, BT_WORD(gen, BT_S_PENDING), memory_order_release);
    t->next = bk->head;
    bk->head = t;
    uint32_t len = ++bk->length;
    bk->scheduled++;
    if (__builtin_expect(len >= bk->prune_at, 0)) {
        prune_locked(tt, bk);
        len = bk->length;
    }
    int earlier = deadline < bk->nearest;
    if (earlier) bk->nearest = deadline;
    int drain = len >= tt->opt.drain_threshold && (len % tt->opt.drain_threshold) == 0;
    /* Read before the unlock: after it, the slot may fire and be freed. */
    uint64_t id = ((uint64_t)gen << 32) | t->slot;
    pthread_mutex_unlock(&bk->mutex);

    *out_id = id;

    if (tt->opt.manual_clock) {
        if (drain) request_collect(tt);
        return 0;
    }
    /* Rule 4: only a deadline earlier than the global nearest wakes the
     * thread; the wake itself happens outside every lock. */
    int wake = 0;
    if (earlier || drain) {
        pthread_mutex_lock(&tt->wake_mutex);
        if (deadline < tt->nearest) {
            tt->nearest = deadline;
            wake = 1;
        }
        if (drain) {
            tt->nearest = INT64_MIN; /* "collect now" */
            wake = 1;
        }
        if (wake) atomic_fetch_add_explicit(&tt->nsignals, 1, memory_order_relaxed);
        pthread_mutex_unlock(&tt->wake_mutex);
    }
    if (wake) {
        atomic_fetch_add_explicit(&bk->wakeups, 1, memory_order_relaxed);
        bt__futex_wake(&tt->nsignals);
    }
    return 0;
}

int bt_schedule_native(bt_timer_thread *tt, int64_t deadline_ns, bt_native_fn fn, void *arg,
                       uint64_t *out_id) {
    if (!fn) return -EINVAL;
    return schedule(tt, deadline_ns, NULL, fn, arg, out_id);
}

int bt_schedule_port(bt_timer_thread *tt, int64_t deadline_ns, bt_port *port, void *payload,
                     uint64_t *out_id) {
    if (!port || port->tt != tt) return -EINVAL;
    return schedule(tt, deadline_ns, port, NULL, payload, out_id);
}

/* ---- cancel (rules 1 and 2) ---------------------------------------------- */

int bt_cancel(bt_timer_thread *tt, uint64_t id) {
    if (!tt || id == 0 || forked(tt)) return BT_UNKNOWN;
    struct bt_timer *t = bt__slot(tt, id);
    if (!t) return BT_UNKNOWN;
    uint32_t gen = (uint32_t)(id >> 32);
    uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);
    for (;;) {
        if (BT_WORD_GEN(w) != gen) return BT_UNKNOWN;
        uint32_t st = BT_WORD_STATE(w);
        if (st == BT_S_FREE) return BT_UNKNOWN;
        if (st != BT_S_PENDING && st != BT_S_POSTED) return BT_TOO_LATE;
        if (atomic_compare_exchange_weak_explicit(&t->word, &w, BT_WORD(gen, BT_S_CANCELLED),
                                                  memory_order_acq_rel, memory_order_acquire)) {
            struct bt__bucket *bk = &tt->buckets[bucket_of_caller(tt)];
            uint64_t n = atomic_fetch_add_explicit(&bk->cancelled, 1, memory_order_relaxed) + 1;
            /* Rule 5 needs the thread to look at its garbage even when no
             * schedule or deadline wakes it: every drain_threshold cancels
             * of one bucket ask it to collect and consider a sweep. */
            if (__builtin_expect(n % tt->opt.drain_threshold == 0, 0)) request_collect(tt);
            return BT_CANCELLED;
        }
    }
}

/* ---- the pass: collect, sweep, fire ----------------------------------------
 * Everything below runs on the timer thread, or in manual-clock mode under
 * advance_mutex: the heap and the reap chains have exactly one owner. */


static inline int is_cancelled(struct bt_timer *t) {
    return BT_WORD_STATE(atomic_load_explicit(&t->word, memory_order_acquire)) == BT_S_CANCELLED;
}

/* Queues a cancelled slot to go back to its bucket's free list at the end of
 * the pass: one lock per bucket per pass, not one per slot.  (ctx: the core;
 * a void * so that heap sweeps can call it.) */
static void reap(struct bt_timer *t, void *ctx) {
    bt_timer_thread *tt = ctx;
    if (!bt__slot_retire(tt, t)) { /* its generations are used up (rule 1) */
        bt__bump(&tt->reaped, 1);
        return;
    }
    struct reap_chain *c = &tt->chains[t->bucket];
    t->next = c->head;
    c->head = t;
    if (!c->tail) c->tail = t;
    c->n++;
}

/* Where the reaped counter moves (and in reap, for a retired slot). */
static uint64_t flush_reaped(bt_timer_thread *tt) {
    struct reap_chain *chains = tt->chains;
    uint64_t n = 0;
    for (uint32_t b = 0; b < tt->nbuckets; b++) {
        if (!chains[b].n) continue;
        bt__pool_free_chain(tt, b, chains[b].head, chains[b].tail, chains[b].n);
        n += chains[b].n;
        chains[b].head = chains[b].tail = NULL;
        chains[b].n = 0;
    }
    bt__bump(&tt->reaped, n);
    return n;
}

/* Out of memory for the heap: gives t and the rest of its list back to
 * bucket b, and makes sure the thread comes back for them. */
static void give_back(bt_timer_thread *tt, uint32_t b, struct bt_timer *t) {
    struct bt__bucket *bk = &tt->buckets[b];
    struct bt_timer *last = t;
    uint32_t n = 1;
    int64_t nearest = t->deadline;
    while (last->next) {
        last = last->next;
        n++;
        if (last->deadline < nearest) nearest = last->deadline;
    }
    pthread_mutex_lock(&bk->mutex);
    last->next = bk->head;
    bk->head = t;
    bk->length += n;
    if (nearest < bk->nearest) bk->nearest = nearest;
    pthread_mutex_unlock(&bk->mutex);
    pthread_mutex_lock(&tt->wake_mutex);
    if (nearest < tt->nearest) tt->nearest = nearest;
    pthread_mutex_unlock(&tt->wake_mutex);
}

/* Moves every bucket list into the heap, reaping cancelled timers on the way.
 *
 * Rule 7: the lists are taken under every bucket lock at once (in bucket
 * order; nothing else holds two), so a collect is a snapshot.  If B's
 * schedule happens after A's returned and B is in the snapshot, so is A: A's
 * critical section came before B's, which came before the collect held B's
 * bucket, and the collect held A's bucket at that moment too.  So A reaches
 * the heap no later than B, and the heap's (deadline, seq) order fires A
 * first when deadline(A) <= deadline(B).  Taking the lists one lock at a
 * time could take B and leave A, scheduled in between into a bucket already
 * passed, for the next pass.  The locks are held for the swaps only. */
static void collect(bt_timer_thread *tt) {
    struct bt_timer *lists[BT_MAX_BUCKETS];
    size_t total = 0;
    for (uint32_t b = 0; b < tt->nbuckets; b++) pthread_mutex_lock(&tt->buckets[b].mutex);
    for (uint32_t b = 0; b < tt->nbuckets; b++) {
        struct bt__bucket *bk = &tt->buckets[b];
        lists[b] = bk->head;
        total += bk->length;
        bk->head = NULL;
        bk->length = 0;
        bk->nearest = BT_NEVER;
        bk->prune_at = 2 * tt->opt.drain_threshold;
    }
    for (uint32_t b = tt->nbuckets; b-- > 0;) pthread_mutex_unlock(&tt->buckets[b].mutex);
    /* Reserve heap room for everything outside the locks; if this fails,
     * bt__heap_push below tries again and reports it. */
    if (tt->heap.size + total > tt->heap.cap) {
        size_t cap = tt->heap.cap ? tt->heap.cap : 1024;
        while (cap < tt->heap.size + total) cap *= 2;
        void *v = realloc(tt->heap.v, cap * sizeof(*tt->heap.v));
        if (v) {
            tt->heap.v = v;
            tt->heap.cap = cap;
        }
    }
    for (uint32_t b = 0; b < tt->nbuckets; b++) {
        for (struct bt_timer *t = lists[b], *next; t; t = next) {
            next = t->next;
            if (is_cancelled(t)) {
                reap(t, tt);
            } else if (bt__heap_push(&tt->heap, t)) {
                give_back(tt, b, t);
                break;
            }
        }
    }
}

static uint64_t sum_cancelled(bt_timer_thread *tt) {
    uint64_t n = 0;
    for (uint32_t b = 0; b < tt->nbuckets; b++)
        n += atomic_load_explicit(&tt->buckets[b].cancelled, memory_order_relaxed);
    return n;
}

static uint64_t reaped_total(bt_timer_thread *tt) {
    uint64_t n = atomic_load_explicit(&tt->reaped, memory_order_relaxed) +
                 atomic_load_explicit(&tt->consumer_reaped, memory_order_relaxed);
    for (uint32_t b = 0; b < tt->nbuckets; b++) {
        pthread_mutex_lock(&tt->buckets[b].mutex);
        n += tt->buckets[b].reaped;
        pthread_mutex_unlock(&tt->buckets[b].mutex);
    }
    return n;
}

/* Rule 5: sweep the heap when cancelled entries pass half of it.  The count
 * of dead entries is cancels that won minus slots reaped; it also counts
 * timers cancelled while waiting in a port, so it can overestimate: what a
 * finished sweep could not find is remembered as a base, so the same
 * phantom entries never trigger sweep after sweep.
 *
 * The sweep itself runs in slices of SWEEP_SLICE positions (each one a
 * likely cache miss on a slot), between which the thread fires what is due:
 * cancelling a million timers at once must not make the next timer late by
 * the time it takes to look at a million slots. */
#define SWEEP_SLICE 2048

static uint64_t dead_estimate(bt_timer_thread *tt) {
    uint64_t c = sum_cancelled(tt), r = reaped_total(tt);
    return c > r ? c - r : 0;
}

static void maybe_start_sweep(bt_timer_thread *tt) {
    if (tt->sweep_cursor != SIZE_MAX) return;
    size_t size = tt->heap.size;
    if (size < tt->opt.sweep_min) return;
    uint64_t dead = dead_estimate(tt);
    if (dead < tt->sweep_dead_base) tt->sweep_dead_base = dead;
    if ((dead - tt->sweep_dead_base) * 2 <= size) return;
    tt->sweep_cursor = 0;
}

/* Runs one slice of a sweep in progress, or (budget SIZE_MAX) all of it in
 * one exact O(n) compaction. */
static void sweep_some(bt_timer_thread *tt, size_t budget) {
    if (tt->sweep_cursor == SIZE_MAX) return;
    int done = 1;
    if (budget == SIZE_MAX) {
        bt__heap_sweep(&tt->heap, is_cancelled, reap, tt);
    } else {
        size_t removed = 0;
        done = bt__heap_sweep_step(&tt->heap, is_cancelled, reap, tt, &tt->sweep_cursor, budget,
                                   &removed);
    }
    flush_reaped(tt);
    if (done) {
        tt->sweep_cursor = SIZE_MAX;
        tt->sweep_dead_base = dead_estimate(tt);
        bt__heap_shrink(&tt->heap);
        bt__bump(&tt->sweeps, 1);
    }
}

static void maybe_sweep(bt_timer_thread *tt) {
    maybe_start_sweep(tt);
    sweep_some(tt, SIZE_MAX);
}

/* Takes every bucket list into the heap and gives the cancelled slots
 * back; then sweeps the heap at once (sweep_now: manual-clock mode, exact)
 * or starts a sliced sweep the thread runs between passes. */
static void collect_lists(bt_timer_thread *tt, int sweep_now) {
    collect(tt);
    flush_reaped(tt);
    if (sweep_now) maybe_sweep(tt);
    else maybe_start_sweep(tt);
}

/* Adds a fired timer to its port's batch for this pass. */
static void stage_post(bt_timer_thread *tt, struct bt_timer *t) {
    bt_port *p = BT_LOAD(t->port);
    t->next = p->pass_head; /* newest first, as the port's stack wants */
    p->pass_head = t;
    if (!p->pass_tail) p->pass_tail = t;
    if (!p->in_pass) {
        p->in_pass = 1;
        p->pass_next = tt->pass_ports;
        tt->pass_ports = p;
    }
}

/* Hands each port its batch: one push and at most one fd write per port per
 * pass (rule 8).  A port detached since gets nothing: its batch goes to the
 * orphan port, whose consumer releases it (rule 11; port.c says why no
 * timer can be left behind in a detached port). */
static void flush_posts(bt_timer_thread *tt) {
    bt_port *p = tt->pass_ports;
    tt->pass_ports = NULL;
    while (p) {
        bt_port *next = p->pass_next;
        if (!bt__port_post(p, p->pass_head, p->pass_tail))
            bt__port_post(tt->orphans, p->pass_head, p->pass_tail);
        p->pass_head = p->pass_tail = NULL;
        p->pass_next = NULL;
        p->in_pass = 0;
        p = next;
    }
}

/* Counts what is staged, then hands it to the ports: a consumer that sees a
 * timer run (or a native callback that reads the counters) then finds it in
 * `fired`/`posted` too. */
static void publish_posts(bt_timer_thread *tt, uint64_t *fired, uint64_t *posted) {
    if (*fired) bt__bump(&tt->fired, *fired);
    if (*posted) bt__bump(&tt->posted, *posted);
    *fired = *posted = 0;
    flush_posts(tt);
}

/* Under wake_mutex: whether the bucket lists must be collected at `now`
 * (one of their deadlines is due, or a list asked for it); if so the request
 * is taken. */
static int collect_requested(bt_timer_thread *tt, int64_t now) {
    if (tt->nearest == INT64_MIN) bt__bump(&tt->drains, 1);
    if (tt->nearest > now) return 0;
    tt->nearest = BT_NEVER;
    return 1;
}

/* brpc's pull_again.  A schedule that lowers the lists' nearest deadline
 * bumps nsignals; if that happened since the pass collected and the new
 * deadline is due at the pass's `now`, the caller collects the lists again,
 * so a timer due now does not wait behind the rest of a long batch (rule 7).
 * Looked at every PULL_EVERY fires and after every native callback: a
 * relaxed load, and wake_mutex only when the counter moved.  (Manual-clock
 * schedules never bump it: bt_advance collects once per call.) */
#define PULL_EVERY 64

static int pull_again(bt_timer_thread *tt, int64_t now) {
    uint32_t n = atomic_load_explicit(&tt->nsignals, memory_order_relaxed);
    if (n == tt->signals_seen) return 0;
    tt->signals_seen = n;
    pthread_mutex_lock(&tt->wake_mutex);
    int do_collect = collect_requested(tt, now);
    pthread_mutex_unlock(&tt->wake_mutex);
    return do_collect;
}

/* Pops and fires every timer due at `now`, dropping cancelled entries that
 * reach the top on the way.  At most dead_budget of those are dropped per
 * call: a million cancelled timers at the top would otherwise hold up, for
 * as long as their slots take to read, a new timer that the next collect
 * would put above them.  Sets *more when it stopped for that reason. */
static uint64_t fire_due(bt_timer_thread *tt, int64_t now, size_t dead_budget, int *more) {
    uint64_t fired = 0, posted = 0, total = 0;
    unsigned since_look = 0;
    const struct bt__heap_entry *top;
    *more = 0;
    while ((top = bt__heap_top(&tt->heap)) != NULL) {
        struct bt_timer *t = top->timer;
        if (is_cancelled(t)) {
            /* Lazy deletion: a dead top is dropped whether due or not. */
            if (dead_budget-- == 0) {
                *more = 1;
                break;
            }
            bt__heap_pop(&tt->heap);
            reap(t, tt);
            continue;
        }
        if (top->deadline > now) break; /* rule 6: due means deadline <= now */
        bt__heap_pop(&tt->heap);
        uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);
        uint32_t gen = BT_WORD_GEN(w);
        uint64_t expected = BT_WORD(gen, BT_S_PENDING);
        if (BT_LOAD(t->port)) {
            if (!atomic_compare_exchange_strong_explicit(&t->word, &expected,
                                                         BT_WORD(gen, BT_S_POSTED),
                                                         memory_order_acq_rel,
                                                         memory_order_acquire)) {
                reap(t, tt);
                continue;
            }
            stage_post(tt, t);
            posted++;
            fired++;
            total++;
            if (++since_look == PULL_EVERY) {
                since_look = 0;
                /* Only timers due at the pass's start can join it, so only
                 * schedulers with deadlines in the past keep it going: post
                 * what is staged before taking more, and let bt_stop end it. */
                if (atomic_load_explicit(&tt->stop, memory_order_relaxed)) break;
                if (pull_again(tt, now)) {
                    publish_posts(tt, &fired, &posted);
                    collect_lists(tt, 0);
                }
            }
        } else {
            if (!atomic_compare_exchange_strong_explicit(&t->word, &expected,
                                                         BT_WORD(gen, BT_S_RUNNING),
                                                         memory_order_acq_rel,
                                                         memory_order_acquire)) {
                reap(t, tt);
                continue;
            }
            fired++;
            total++;
            int64_t late = bt__lateness(bt_time_ns(tt), t->deadline);
            if (late < 0) bt__bump(&tt->early_native, 1);
            bt__hist_add(tt->hist_native, late);
            /* Post what is staged first: a native callback may be slow. */
            publish_posts(tt, &fired, &posted);
            t->fn(BT_LOAD(t->arg), ((uint64_t)gen << 32) | t->slot);
            bt__bump(&tt->ran_native, 1);
            if (bt__slot_retire(tt, t)) bt__pool_free_chain(tt, t->bucket, t, t, 1);
            /* A callback that stopped the core: nothing more runs. */
            if (atomic_load_explicit(&tt->stop, memory_order_relaxed)) break;
            since_look = 0;
            if (pull_again(tt, now)) collect_lists(tt, 0);
        }
    }
    publish_posts(tt, &fired, &posted);
    return total;
}

#define DEAD_POP_SLICE 2048

static uint64_t one_pass(bt_timer_thread *tt, int64_t now, int do_collect, size_t dead_budget,
                         int *more) {
    if (do_collect) collect_lists(tt, 1);
    uint64_t fired = fire_due(tt, now, dead_budget, more);
    flush_reaped(tt);
    bt__bump(&tt->passes, 1);
    atomic_store_explicit(&tt->heap_size, tt->heap.size, memory_order_relaxed);
    return fired;
}

static void request_collect(bt_timer_thread *tt) {
    if (!tt->opt.manual_clock) {
        /* Ask the thread for a collect pass, as a full bucket list does. */
        pthread_mutex_lock(&tt->wake_mutex);
        tt->nearest = INT64_MIN;
        atomic_fetch_add_explicit(&tt->nsignals, 1, memory_order_relaxed);
        pthread_mutex_unlock(&tt->wake_mutex);
        bt__futex_wake(&tt->nsignals);
        return;
    }
    /* Manual-clock mode: the calling thread collects itself.  If a
     * bt_advance is running (perhaps this very thread, in a native callback)
     * it will collect anyway: never wait for it. */
    if (pthread_mutex_trylock(&tt->advance_mutex) != 0) return;
    collect_lists(tt, 1);
    bt__bump(&tt->drains, 1);
    atomic_store_explicit(&tt->heap_size, tt->heap.size, memory_order_relaxed);
    pthread_mutex_unlock(&tt->advance_mutex);
}

/* ---- the timer thread (rule 4) -------------------------------------------
 * It collects bucket lists only when one of their deadlines is due (the
 * global nearest is a lower bound of every list's deadlines) or when a list
 * passed the drain threshold; otherwise a wake just moves its sleep earlier.
 * So a burst of schedules far in the future costs one wake, not one per
 * pass. */

static void destroy_now(bt_timer_thread *tt);

static void *timer_thread_main(void *arg) {
    bt_timer_thread *tt = arg;
    pass_owner = tt;
#if defined(__linux__) && defined(PR_SET_TIMERSLACK)
    /* Linux lets a sleep run up to 50 us past its deadline by default, to
     * batch wakeups; that slack was most of a timer's lateness.  One
     * thread per process can afford 1 ns. */
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
#endif
    for (;;) {
        int64_t now = bt_now_ns();
        int do_collect;
        pthread_mutex_lock(&tt->wake_mutex);
        if (atomic_load_explicit(&tt->stop, memory_order_relaxed)) {
            pthread_mutex_unlock(&tt->wake_mutex);
            break;
        }
        do_collect = collect_requested(tt, now);
        tt->signals_seen = atomic_load_explicit(&tt->nsignals, memory_order_relaxed);
        pthread_mutex_unlock(&tt->wake_mutex);

        /* Re-read the clock after collecting: never fire on a stale now. */
        if (do_collect) {
            collect_lists(tt, 0);
        }
        int more_dead = 0;
        one_pass(tt, bt_now_ns(), 0, DEAD_POP_SLICE, &more_dead);
        int sweeping = 0;
        if (tt->sweep_cursor != SIZE_MAX) {
            sweep_some(tt, SWEEP_SLICE);
            sweeping = tt->sweep_cursor != SIZE_MAX;
            atomic_store_explicit(&tt->heap_size, tt->heap.size, memory_order_relaxed);
        }

        const struct bt__heap_entry *top = bt__heap_top(&tt->heap);
        int64_t next = top ? top->deadline : BT_NEVER;
        pthread_mutex_lock(&tt->wake_mutex);
        if (tt->nearest < next) next = tt->nearest;
        uint32_t expected = atomic_load_explicit(&tt->nsignals, memory_order_relaxed);
        int stop = atomic_load_explicit(&tt->stop, memory_order_relaxed);
        pthread_mutex_unlock(&tt->wake_mutex);
        if (stop) break;
        /* Next slice of garbage after another look at what is due. */
        if (sweeping || more_dead) continue;
        now = bt_now_ns();
        if (next <= now) continue;
        bt__futex_wait(&tt->nsignals, expected, next == BT_NEVER ? -1 : next - now);
    }
    if (tt->destroy_later) {
        /* bt_destroy came from one of our callbacks: nobody will join us. */
        pthread_detach(pthread_self());
        destroy_now(tt);
    }
    return NULL;
}

/* ---- manual clock (rule 9) ------------------------------------------------ */

int64_t bt_advance(bt_timer_thread *tt, int64_t now_ns) {
    if (!tt) return -EINVAL;
    if (!tt->opt.manual_clock) return -EINVAL;
    if (forked(tt)) return -ECHILD;
    if (atomic_load_explicit(&tt->stop, memory_order_acquire)) return -ESHUTDOWN;
    pthread_mutex_lock(&tt->advance_mutex);
    int64_t cur = atomic_load_explicit(&tt->manual_now, memory_order_relaxed);
    if (now_ns > cur) atomic_store_explicit(&tt->manual_now, now_ns, memory_order_release);
    else now_ns = cur;
    int more;
    bt_timer_thread *outer = pass_owner; /* a native callback of another core's pass */
    pass_owner = tt;
    uint64_t fired = one_pass(tt, now_ns, 1, SIZE_MAX, &more);
    pass_owner = outer;
    pthread_mutex_unlock(&tt->advance_mutex);
    if (tt->destroy_later) destroy_now(tt); /* a callback asked for it */
    return (int64_t)fired;
}

int64_t bt_next_deadline(bt_timer_thread *tt) {
    if (!tt || forked(tt)) return BT_NEVER;
    int64_t next = BT_NEVER;
    if (tt->opt.manual_clock) {
        /* Exact: collect, drop dead tops, read the top. */
        pthread_mutex_lock(&tt->advance_mutex);
        collect(tt);
        const struct bt__heap_entry *top;
        while ((top = bt__heap_top(&tt->heap)) && is_cancelled(top->timer))
            reap(bt__heap_pop(&tt->heap), tt);
        flush_reaped(tt);
        if (top) next = top->deadline;
        atomic_store_explicit(&tt->heap_size, tt->heap.size, memory_order_relaxed);
        pthread_mutex_unlock(&tt->advance_mutex);
        return next;
    }
    pthread_mutex_lock(&tt->wake_mutex);
    next = tt->nearest;
    pthread_mutex_unlock(&tt->wake_mutex);
    return next;
}

/* ---- stop, drop, destroy (rule 11) ----------------------------------------
 * bt_stop sets the flag, fences the buckets and joins the thread, one caller
 * at a time under stop_mutex: every caller returns only once the thread is
 * joined.  A native callback runs on the thread itself, which cannot join
 * itself: bt_stop from there sets the flag, fences the buckets and returns;
 * the pass stops after that callback, the thread leaves its loop, and the
 * next bt_stop from any other thread (bt_destroy's included) joins it.
 * bt_destroy from a native callback cannot free what the pass still uses:
 * it stops the core and leaves the freeing to the thread (or to bt_advance)
 * once the callback has returned. */

/* A schedule in flight either saw the stop flag or has published its timer
 * once we hold its bucket's lock. */
static void fence_buckets(bt_timer_thread *tt) {
    for (uint32_t b = 0; b < tt->nbuckets; b++) {
        pthread_mutex_lock(&tt->buckets[b].mutex);
        pthread_mutex_unlock(&tt->buckets[b].mutex);
    }
}

int bt_stop(bt_timer_thread *tt) {
    if (!tt) return -EINVAL;
    if (forked(tt)) return 0;
    pthread_mutex_lock(&tt->wake_mutex);
    atomic_store(&tt->stop, 1);
    atomic_fetch_add_explicit(&tt->nsignals, 1, memory_order_relaxed);
    pthread_mutex_unlock(&tt->wake_mutex);
    if (pass_owner == tt) { /* a native callback of this core */
        fence_buckets(tt);
        return 0;
    }
    pthread_mutex_lock(&tt->stop_mutex);
    fence_buckets(tt);
    if (tt->started) {
        bt__futex_wake(&tt->nsignals);
        pthread_join(tt->thread, NULL);
        tt->started = 0;
    }
    pthread_mutex_unlock(&tt->stop_mutex);
    return 0;
}

int64_t bt_drop_all(bt_timer_thread *tt, bt_drop_fn on_drop, void *ctx) {
    if (!tt) return -EINVAL;
    if (forked(tt)) return 0;
    if (!atomic_load(&tt->stop)) return -EBUSY;
    /* Walk every slot: PENDING ones sit in lists or the heap, POSTED ones in
     * ports; both become CANCELLED, and their owners reap them as usual. */
    int64_t dropped = 0;
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
                 * retire and reuse it at once.  The acquire load of w made
                 * the fields of this generation visible; if the slot moved
                 * on since, the CAS fails. */
                bt_port *port = BT_LOAD(t->port);
                void *arg = BT_LOAD(t->arg);
                if (atomic_compare_exchange_weak_explicit(
                        &t->word, &w, BT_WORD(BT_WORD_GEN(w), BT_S_CANCELLED),
                        memory_order_acq_rel, memory_order_acquire)) {
                    atomic_fetch_add_explicit(&tt->buckets[0].cancelled, 1,
                                              memory_order_relaxed);
                    dropped++;
                    if (on_drop) on_drop(ctx, port, arg);
                    break;
                }
            }
        }
    }
    return dropped;
}

/* Frees everything; the thread, if any, is joined or is the caller. */
static void destroy_now(bt_timer_thread *tt) {
    bt_port *p = tt->ports;
    while (p) {
        bt_port *next = p->all_next;
        bt__port_free(p);
        p = next;
    }
    bt__heap_free(&tt->heap);
    bt__pool_destroy(tt);
    for (uint32_t b = 0; b < tt->nbuckets; b++) pthread_mutex_destroy(&tt->buckets[b].mutex);
    pthread_mutex_destroy(&tt->wake_mutex);
    pthread_mutex_destroy(&tt->advance_mutex);
    pthread_mutex_destroy(&tt->ports_mutex);
    pthread_mutex_destroy(&tt->stop_mutex);
    give_tag(tt);
    free(tt->chains);
    free(tt->buckets);
    munmap(tt, sizeof(*tt));
}

void bt_destroy(bt_timer_thread *tt) {
    if (!tt) return;
    if (forked(tt)) return; /* its locks may be held by threads that are gone */
    bt_stop(tt);
    if (pass_owner == tt) { /* a native callback: the pass still uses tt */
        tt->destroy_later = 1;
        return;
    }
    destroy_now(tt);
}

/* ---- counters (rule 10) ------------------------------------------------- */

void bt_get_stats(bt_timer_thread *tt, bt_stats *s) {
    memset(s, 0, sizeof(*s));
    if (!tt || forked(tt)) return;
    for (uint32_t b = 0; b < tt->nbuckets; b++) {
        struct bt__bucket *bk = &tt->buckets[b];
        pthread_mutex_lock(&bk->mutex);
        s->scheduled += bk->scheduled;
        s->list_size += bk->length;
        s->slots_free += bk->nfree;
        s->reaped += bk->reaped;
        pthread_mutex_unlock(&bk->mutex);
        s->cancelled += atomic_load_explicit(&bk->cancelled, memory_order_relaxed);
        s->wakeups += atomic_load_explicit(&bk->wakeups, memory_order_relaxed);
    }
#define LD(x) atomic_load_explicit(&tt->x, memory_order_relaxed)
    s->fired = LD(fired);
    s->posted = LD(posted);
    s->passes = LD(passes);
    s->drains = LD(drains);
    s->sweeps = LD(sweeps);
    s->reaped += LD(reaped) + LD(consumer_reaped);
    s->heap_size = LD(heap_size);
    s->eventfd_writes = LD(eventfd_writes);
    s->ran = LD(ran_native);
    s->early_fires = LD(early_native);
    for (int i = 0; i < 48; i++) s->lateness_hist[i] = LD(hist_native[i]);
    s->slots_retired = LD(slots_retired);
#undef LD
    s->dead = s->cancelled > s->reaped ? s->cancelled - s->reaped : 0;
    s->slots = (uint64_t)atomic_load(&tt->nblocks) * BT_BLOCK_SLOTS;
    pthread_mutex_lock(&tt->ports_mutex);
    s->ports = tt->nports;
    for (bt_port *p = tt->ports; p; p = p->all_next) {
        s->ran += atomic_load_explicit(&p->ran, memory_order_relaxed);
        s->dropped += atomic_load_explicit(&p->dropped, memory_order_relaxed);
        s->early_fires += atomic_load_explicit(&p->early, memory_order_relaxed);
        for (int i = 0; i < 48; i++)
            s->lateness_hist[i] += atomic_load_explicit(&p->hist[i], memory_order_relaxed);
    }
    pthread_mutex_unlock(&tt->ports_mutex);
}
