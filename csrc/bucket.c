/*
 * bucket.c -- the callers' side: which bucket a thread uses, schedule and
 * cancel (docs/design.rst, rules 1-5).
 *
 * A bucket's list, free list, length, nearest deadline and counters are
 * guarded by its mutex; its cancelled/wakeups counters are relaxed atomics.
 * A slot's state word is the only thing a cancel touches (a CAS), so cancel
 * needs no lock.  The wake protocol is wake.c's, asked only for a deadline
 * earlier than the bucket's nearest (or a list that wants a drain).
 */
#define _GNU_SOURCE
#include <errno.h>

#include "internal.h"

/* ---- the calling thread's bucket (rule 3) --------------------------------
 * Thread-local, assigned round robin on first use: timers of one thread stay
 * together, and two threads rarely share a lock.
 *
 * The index uses the initial-exec TLS model: in a shared object the default
 * model calls __tls_get_addr on every access, twice per schedule+cancel
 * pair; initial-exec reads it at a fixed offset from the thread pointer
 * (glibc keeps static TLS room for dlopen()ed objects' few bytes). */

static _Atomic uint32_t next_thread_index;
static _Thread_local uint32_t thread_index_plus_one BT_TLS_IE;

static inline uint32_t bucket_of_caller(const bt_timer_thread *tt) {
    uint32_t i = thread_index_plus_one;
    if (__builtin_expect(i == 0, 0)) {
        i = atomic_fetch_add_explicit(&next_thread_index, 1, memory_order_relaxed) + 1;
        thread_index_plus_one = i;
    }
    uint32_t k = i - 1;
    return k < tt->nbuckets ? k : k % tt->nbuckets; /* no division for the first threads */
}

/* ---- scheduling ------------------------------------------------------------ */

/* Under the bucket mutex: a cancelled slot, unlinked from the list, back on
 * the bucket's free list with its next generation (unless retired). */
static inline void free_slot_locked(bt_timer_thread *tt, struct bt__bucket *bk,
                                    struct bt_timer *t) {
    if (bt__slot_retire(tt, t)) {
        t->next = bk->free;
        bk->free = t;
        bk->nfree++;
    }
}

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
            free_slot_locked(tt, bk, t);
            removed++;
        } else {
            link = &t->next;
            kept++;
        }
    }
    bk->length = kept;
    bk->reaped += removed;
    bk->prune_at = bt__prune_at(tt, kept);
}

/* The steps of a schedule, each inlined into schedule_timer() below. */

/* Under the bucket lock, before a push: if the newest entry of the list (this
 * thread's last schedule, most often) was cancelled since, unlinks it and
 * gives its slot back first, so the push below takes that same slot.  A
 * schedule+cancel loop then keeps to one warm slot instead of walking the
 * free list through cold ones until a prune or a pass reaps them (rule 5:
 * the list's garbage, reaped a node early). */
static inline void reap_cancelled_head_locked(bt_timer_thread *tt, struct bt__bucket *bk) {
    struct bt_timer *t = bk->head;
    if (!t || !bt__is_cancelled(t)) return;
    bk->head = t->next;
    bk->length--;
    bk->reaped++;
    free_slot_locked(tt, bk, t);
}

/* Takes bucket b's lock with a free slot on its free list: 0 with the lock
 * held, or -ESHUTDOWN or the pool's error without it. */
static inline int lock_with_free_slot(bt_timer_thread *tt, uint32_t b, struct bt__bucket *bk) {
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
        reap_cancelled_head_locked(tt, bk);
        if (bk->free) return 0;
        /* Allocation happens outside the bucket lock (rule 3). */
        pthread_mutex_unlock(&bk->mutex);
        int rc = bt__pool_grow(tt, b);
        if (rc) return rc;
        pthread_mutex_lock(&bk->mutex);
    }
}

/* Under the bucket lock: pops a free slot, fills it, publishes it PENDING
 * and pushes it on the bucket's list.  Returns its id, read now: after the
 * unlock the slot may fire and be freed. */
static inline uint64_t push_pending_locked(struct bt__bucket *bk, int64_t deadline, uint64_t seq,
                                           void *target, int native, void *arg) {
    struct bt_timer *t = bk->free;
    bk->free = t->next;
    bk->nfree--;
    BT_STORE(t->deadline, deadline);
    t->seq = seq;
    BT_STORE(t->target, target);
    BT_STORE(t->native, (uint16_t)native);
    BT_STORE(t->arg, arg);
    uint64_t w = atomic_load_explicit(&t->word, memory_order_relaxed);
    uint32_t gen = BT_WORD_GEN(w);
    /* Release: whoever acquires this word sees the fields above. */
    atomic_store_explicit(&t->word, BT_WORD(gen, BT_S_PENDING), memory_order_release);
    t->next = bk->head;
    bk->head = t;
    return ((uint64_t)gen << 32) | t->slot;
}

/* Under the bucket lock, after a push: counts it and prunes the list if it
 * reached prune_at (rule 5).  Returns the list's length. */
static inline uint32_t count_push_locked(bt_timer_thread *tt, struct bt__bucket *bk) {
    uint32_t len = ++bk->length;
    bk->scheduled++;
    if (__builtin_expect(len >= bk->prune_at, 0)) {
        prune_locked(tt, bk);
        len = bk->length;
    }
    return len;
}


static int schedule_timer(bt_timer_thread *tt, int64_t deadline, void *target, int native,
                          void *arg, uint64_t *out_id) {
    if (!tt || !out_id) return -EINVAL;
    if (bt__forked(tt)) return -ECHILD;
    uint32_t b = bucket_of_caller(tt);
    struct bt__bucket *bk = &tt->buckets[b];
    uint64_t seq = atomic_fetch_add_explicit(&tt->seq, 1, memory_order_relaxed);

    int rc = lock_with_free_slot(tt, b, bk);
    if (rc) return rc;
    uint64_t id = push_pending_locked(bk, deadline, seq, target, native, arg);
    uint32_t len = count_push_locked(tt, bk);
    int earlier = deadline < bk->nearest;
    if (earlier) bk->nearest = deadline;
    int drain = len >= tt->opt.drain_threshold && (len % tt->opt.drain_threshold) == 0;
    pthread_mutex_unlock(&bk->mutex);

    *out_id = id;
    if (!native) bt__port_lower_lb(target, deadline);
    if (tt->opt.manual_clock) {
        if (drain) bt__request_collect(tt);
    } else if (earlier || drain) {
        /* Rule 4, the bucket lock dropped: wake.c wakes the thread only if
         * the deadline is earlier than the global nearest too. */
        if (bt__wake_for(tt, deadline, drain))
            atomic_fetch_add_explicit(&bk->wakeups, 1, memory_order_relaxed);
    }
    return 0;
}

int bt_schedule_native(bt_timer_thread *tt, int64_t deadline_ns, bt_native_fn fn, void *arg,
                       uint64_t *out_id) {
    if (!fn) return -EINVAL;
    union bt__fn_ptr f = {.fn = fn};
    return schedule_timer(tt, deadline_ns, f.p, 1, arg, out_id);
}

int bt_schedule_port(bt_timer_thread *tt, int64_t deadline_ns, bt_port *port, void *payload,
                     uint64_t *out_id) {
    if (!port || port->tt != tt) return -EINVAL;
    return schedule_timer(tt, deadline_ns, port, 0, payload, out_id);
}

/* ---- cancel (rules 1 and 2) ---------------------------------------------- */

int bt_cancel(bt_timer_thread *tt, uint64_t id) {
    if (!tt || id == 0 || bt__forked(tt)) return BT_UNKNOWN;
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
            if (__builtin_expect(n % tt->opt.drain_threshold == 0, 0)) bt__request_collect(tt);
            return BT_CANCELLED;
        }
    }
}


/* ---- postpone (rule 12) ---------------------------------------------------
 * A later deadline, in place: the slot keeps its place in the list or the
 * heap (its `deadline`, the key) and gets moved_to and BT_F_MOVED.  The pass
 * applies the move when it collects the slot or pops it at its old key: the
 * key becomes moved_to, the flag is cleared, and the slot goes back in the
 * heap.  Postpones and that application hold the slot's home bucket mutex,
 * so the pass only ever reads a moved_to some postpone committed; fire and
 * cancel do not take it, and race a postpone through the word's CAS.  Only
 * later deadlines: an earlier one would have to come up the heap before the
 * old key does (BT_EARLIER: cancel and schedule instead). */

int bt_postpone(bt_timer_thread *tt, uint64_t id, int64_t deadline_ns) {
    if (!tt || id == 0 || bt__forked(tt)) return BT_UNKNOWN;
    struct bt_timer *t = bt__slot(tt, id);
    if (!t) return BT_UNKNOWN;
    uint32_t gen = (uint32_t)(id >> 32);
    struct bt__bucket *bk = &tt->buckets[t->bucket];
    pthread_mutex_lock(&bk->mutex);
    uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);
    int rc;
    for (;;) {
        if (BT_WORD_GEN(w) != gen || BT_WORD_STATE(w) == BT_S_FREE) {
            rc = BT_UNKNOWN;
        } else if (BT_WORD_STATE(w) != BT_S_PENDING) {
            rc = BT_TOO_LATE;
        } else if (deadline_ns < bt__current_deadline(t, w)) {
            /* The last postpone's target even before the pass applies
             * it: the answer never depends on the timer thread's timing. */
            rc = BT_EARLIER;
        } else {
            BT_STORE(t->moved_to, deadline_ns);
            /* Release: whoever sees the flag sees moved_to.  Only a fire or
             * a cancel can change the word meanwhile. */
            if (!atomic_compare_exchange_weak_explicit(&t->word, &w, w | BT_F_MOVED,
                                                       memory_order_release,
                                                       memory_order_acquire))
                continue;
            bk->postponed++;
            rc = BT_POSTPONED;
        }
        break;
    }
    pthread_mutex_unlock(&bk->mutex);
    return rc;
}
