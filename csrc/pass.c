/*
 * pass.c -- the timer thread's pass: collect the bucket lists into the heap,
 * sweep the heap of cancelled entries, fire what is due and hand it to its
 * ports (docs/design.rst, rules 4-8).
 *
 * Everything here runs under pass_mutex -- on the timer thread, on a
 * consumer's thread in bt_deliver_due, or in bt_advance (manual clock) -- so
 * the heap, the reap chains and the ports' pass batches have one owner at a
 * time.  It takes bucket mutexes (to swap lists and give slots back) and,
 * through wake.c, wake_mutex; never a lock a consumer holds across a call
 * into the core.
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include "internal.h"

/* Queues a cancelled slot to go back to its bucket's free list at the end of
 * the pass: one lock per bucket per pass, not one per slot.  (ctx: the core;
 * a void * so that heap sweeps can call it.) */
void bt__reap(struct bt_timer *t, void *ctx) {
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

/* Where the reaped counter moves (and in bt__reap, for a retired slot). */
uint64_t bt__flush_reaped(bt_timer_thread *tt) {
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
    int64_t nearest = BT_LOAD(t->deadline);
    while (last->next) {
        last = last->next;
        n++;
        int64_t d = BT_LOAD(last->deadline);
        if (d < nearest) nearest = d;
    }
    pthread_mutex_lock(&bk->mutex);
    last->next = bk->head;
    bk->head = t;
    bk->length += n;
    if (nearest < bk->nearest) bk->nearest = nearest;
    pthread_mutex_unlock(&bk->mutex);
    bt__lower_nearest(tt, nearest);
}

/* Applies a postpone to t, which the pass holds (popped, or collected): its
 * key becomes moved_to (bucket.c, "postpone").  0 if a cancel won meanwhile
 * and t was reaped. */
static int apply_move(bt_timer_thread *tt, struct bt_timer *t) {
    struct bt__bucket *bk = &tt->buckets[t->bucket];
    pthread_mutex_lock(&bk->mutex);
    uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);
    while (BT_WORD_STATE(w) == BT_S_PENDING && (w & BT_F_MOVED)) {
        BT_STORE(t->deadline, BT_LOAD(t->moved_to));
        /* Only a cancel can change the word meanwhile (postpones wait for
         * the mutex); release: a postpone that sees the flag clear sees
         * the new key. */
        if (atomic_compare_exchange_weak_explicit(&t->word, &w, w & ~(uint64_t)BT_F_MOVED,
                                                  memory_order_acq_rel, memory_order_acquire))
            break;
    }
    pthread_mutex_unlock(&bk->mutex);
    if (BT_WORD_STATE(w) == BT_S_PENDING) return 1;
    bt__reap(t, tt);
    return 0;
}

static inline int is_moved(struct bt_timer *t) {
    return (atomic_load_explicit(&t->word, memory_order_relaxed) & BT_F_MOVED) != 0;
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
void bt__collect(bt_timer_thread *tt) {
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
        bk->prune_at = bt__prune_at(tt, 0);
    }
    for (uint32_t b = tt->nbuckets; b-- > 0;) pthread_mutex_unlock(&tt->buckets[b].mutex);
    /* Room for everything, outside the locks; if this fails, bt__heap_push
     * below tries again and reports it. */
    (void)bt__heap_reserve(&tt->heap, total);
    for (uint32_t b = 0; b < tt->nbuckets; b++) {
        for (struct bt_timer *t = lists[b], *next; t; t = next) {
            next = t->next;
            if (bt__is_cancelled(t)) {
                bt__reap(t, tt);
            } else if (is_moved(t) && !apply_move(tt, t)) {
                continue;
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
 * The sweep itself runs in slices of BT_SWEEP_SLICE positions (each one a
 * likely cache miss on a slot), between which the thread fires what is due:
 * cancelling a million timers at once must not make the next timer late by
 * the time it takes to look at a million slots. */

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
void bt__sweep_some(bt_timer_thread *tt, size_t budget) {
    if (tt->sweep_cursor == SIZE_MAX) return;
    int done = 1;
    if (budget == SIZE_MAX) {
        bt__heap_sweep(&tt->heap, bt__is_cancelled, bt__reap, tt);
    } else {
        size_t removed = 0;
        done = bt__heap_sweep_step(&tt->heap, bt__is_cancelled, bt__reap, tt, &tt->sweep_cursor, budget,
                                   &removed);
    }
    bt__flush_reaped(tt);
    if (done) {
        tt->sweep_cursor = SIZE_MAX;
        tt->sweep_dead_base = dead_estimate(tt);
        bt__heap_shrink(&tt->heap);
        bt__bump(&tt->sweeps, 1);
    }
}

static void maybe_sweep(bt_timer_thread *tt) {
    maybe_start_sweep(tt);
    bt__sweep_some(tt, SIZE_MAX);
}

/* Takes every bucket list into the heap and gives the cancelled slots
 * back; then sweeps the heap at once (sweep_now: manual-clock mode, exact)
 * or starts a sliced sweep the thread runs between passes. */
void bt__collect_lists(bt_timer_thread *tt, int sweep_now) {
    bt__collect(tt);
    bt__flush_reaped(tt);
    if (sweep_now) maybe_sweep(tt);
    else maybe_start_sweep(tt);
}

/* Adds a fired timer to its port's batch for this pass. */
static void stage_post(bt_timer_thread *tt, struct bt_timer *t) {
    bt_port *p = BT_LOAD(t->target);
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

/* brpc's pull_again is bt__signalled_since (wake.c).  A schedule that
 * lowers the lists' nearest deadline bumps nsignals; if that happened since
 * the pass collected and the new deadline is due at the pass's `now`, the
 * caller collects the lists again, so a timer due now does not wait behind
 * the rest of a long batch (rule 7).
 * Looked at every PULL_EVERY fires and after every native callback: a
 * relaxed load, and wake_mutex only when the counter moved.  (Manual-clock
 * schedules never bump it: bt_advance collects once per call.) */
#define PULL_EVERY 64


/* What became of a timer popped because it is due. */
enum claim { CLAIM_DEAD, CLAIM_MOVED, CLAIM_FIRED };

/* A popped, due timer: PENDING -> POSTED (a port's) or RUNNING (a native
 * one).  A postponed one gets its new key (the caller puts it back), a
 * cancelled one is reaped. */
static enum claim claim_due(bt_timer_thread *tt, struct bt_timer *t, int native) {
    uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);
    for (;;) {
        if (BT_WORD_STATE(w) != BT_S_PENDING) {
            bt__reap(t, tt);
            return CLAIM_DEAD;
        }
        if (w & BT_F_MOVED) return apply_move(tt, t) ? CLAIM_MOVED : CLAIM_DEAD;
        uint64_t to = BT_WORD(BT_WORD_GEN(w), native ? BT_S_RUNNING : BT_S_POSTED);
        if (atomic_compare_exchange_strong_explicit(&t->word, &w, to, memory_order_acq_rel,
                                                    memory_order_acquire))
            return CLAIM_FIRED;
    }
}

const struct bt__heap_entry *bt__settle_top(bt_timer_thread *tt) {
    const struct bt__heap_entry *top;
    while ((top = bt__heap_top(&tt->heap)) != NULL) {
        struct bt_timer *t = top->timer;
        if (bt__is_cancelled(t)) {
            bt__reap(bt__heap_pop(&tt->heap), tt);
        } else if (is_moved(t)) {
            bt__heap_pop(&tt->heap);
            if (apply_move(tt, t)) bt__heap_push(&tt->heap, t); /* room: just popped */
        } else {
            break;
        }
    }
    return top;
}

/* A listed timer's current deadline, or BT_NEVER if it is no longer
 * pending.  Under its bucket's mutex (a listed slot is in its home
 * bucket's list). */
static int64_t live_deadline_locked(struct bt_timer *t) {
    uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);
    return BT_WORD_STATE(w) == BT_S_PENDING ? bt__current_deadline(t, w) : BT_NEVER;
}

int64_t bt__lists_next_live(bt_timer_thread *tt) {
    int64_t next = BT_NEVER;
    for (uint32_t b = 0; b < tt->nbuckets; b++) {
        struct bt__bucket *bk = &tt->buckets[b];
        pthread_mutex_lock(&bk->mutex);
        for (struct bt_timer *t = bk->head; t; t = t->next) {
            int64_t d = live_deadline_locked(t);
            if (d < next) next = d;
        }
        pthread_mutex_unlock(&bk->mutex);
    }
    return next;
}

/* Runs a claimed native timer on this thread, after handing the ports what
 * is staged (a native callback may be slow). */
static void run_native(bt_timer_thread *tt, struct bt_timer *t, uint64_t *fired,
                       uint64_t *posted) {
    uint32_t gen = BT_WORD_GEN(atomic_load_explicit(&t->word, memory_order_relaxed));
    int64_t late = bt__lateness(bt_time_ns(tt), BT_LOAD(t->deadline));
    if (late < 0) bt__bump(&tt->early_native, 1);
    bt__hist_add(tt->hist_native, &tt->late_sum_native, late);
    publish_posts(tt, fired, posted);
    union bt__fn_ptr f = {.p = BT_LOAD(t->target)};
    f.fn(BT_LOAD(t->arg), ((uint64_t)gen << 32) | t->slot);
    bt__bump(&tt->ran_native, 1);
    if (bt__slot_retire(tt, t)) bt__pool_free_chain(tt, t->bucket, t, t, 1);
}

/* Pops and fires every timer due at `now`, dropping cancelled entries that
 * reach the top on the way.  At most dead_budget of those are dropped per
 * call: a million cancelled timers at the top would otherwise hold up, for
 * as long as their slots take to read, a new timer that the next collect
 * would put above them.  Sets *more when it stopped for that reason.  A
 * consumer's pass leaves native timers to the timer thread: it sets them
 * aside and puts them back at their keys (the thread's sleep already ends
 * by then: they were pending when it chose it). */
static uint64_t fire_due(bt_timer_thread *tt, int64_t now, size_t dead_budget, int consumer,
                         int *more) {
    uint64_t fired = 0, posted = 0, total = 0;
    unsigned since_look = 0;
    struct bt_timer *aside = NULL;
    const struct bt__heap_entry *top;
    *more = 0;
    while ((top = bt__heap_top(&tt->heap)) != NULL) {
        struct bt_timer *t = top->timer;
        if (bt__is_cancelled(t)) {
            /* Lazy deletion: a dead top is dropped whether due or not. */
            if (dead_budget-- == 0) {
                *more = 1;
                break;
            }
            bt__heap_pop(&tt->heap);
            bt__reap(t, tt);
            continue;
        }
        if (top->deadline > now) break; /* rule 6: due means deadline <= now */
        bt__heap_pop(&tt->heap);
        int native = BT_LOAD(t->native);
        if (native && consumer) {
            t->next = aside;
            aside = t;
            continue;
        }
        enum claim c = claim_due(tt, t, native);
        if (c == CLAIM_MOVED) bt__heap_push(&tt->heap, t); /* room: it was just popped */
        if (c != CLAIM_FIRED) continue;
        fired++;
        total++;
        if (native) {
            run_native(tt, t, &fired, &posted);
            /* A callback that stopped the core: nothing more runs. */
            if (atomic_load_explicit(&tt->stop, memory_order_relaxed)) break;
            since_look = 0;
            if (bt__signalled_since(tt, now)) bt__collect_lists(tt, 0);
            continue;
        }
        stage_post(tt, t);
        posted++;
        if (++since_look == PULL_EVERY) {
            since_look = 0;
            /* Only timers due at the pass's start can join it, so only
             * schedulers with deadlines in the past keep it going: post what
             * is staged before taking more, and let bt_stop end it. */
            if (atomic_load_explicit(&tt->stop, memory_order_relaxed)) break;
            if (bt__signalled_since(tt, now)) {
                publish_posts(tt, &fired, &posted);
                bt__collect_lists(tt, 0);
            }
        }
    }
    publish_posts(tt, &fired, &posted);
    while (aside) { /* room: each was popped */
        struct bt_timer *t = aside;
        aside = t->next;
        bt__heap_push(&tt->heap, t);
    }
    return total;
}

uint64_t bt__one_pass(bt_timer_thread *tt, int64_t now, int do_collect, size_t dead_budget,
                      int consumer, int *more) {
    bt__reclaim_ports(tt);
    if (do_collect) bt__collect_lists(tt, !consumer);
    uint64_t fired = fire_due(tt, now, dead_budget, consumer, more);
    bt__flush_reaped(tt);
    bt__bump(&tt->passes, 1);
    atomic_store_explicit(&tt->heap_size, tt->heap.size, memory_order_relaxed);
    return fired;
}


