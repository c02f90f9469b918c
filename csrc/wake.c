/*
 * wake.c -- the wake protocol (docs/design.rst, rule 4): the global nearest
 * deadline of the bucket lists, the futex word `nsignals` the timer thread
 * sleeps on, and the stop flag, all three under wake_mutex and nowhere else.
 *
 * A scheduler wakes the thread only for a deadline earlier than the global
 * nearest (or to ask for a collect, BT_COLLECT_NOW); the wake is "lower the
 * nearest, bump the counter" under the mutex, then the futex wake outside
 * it.  The thread reads the nearest and the counter together before it
 * sleeps expecting that counter, so a wake that lands in between makes the
 * sleep return at once: no wake is lost.
 */
#include <errno.h>

#include "internal.h"

/* ---- the callers' side ---------------------------------------------------- */

/* Under wake_mutex: makes `nearest` the global nearest if it is earlier, or
 * (collect) asks for a collect whatever it holds.  1 if the thread must be
 * woken; the counter is bumped, the futex wake is the caller's, unlocked. */
static int lower_locked(bt_timer_thread *tt, int64_t nearest, int collect) {
    if (collect) tt->nearest = BT_COLLECT_NOW;
    else if (nearest < tt->nearest) tt->nearest = nearest;
    else return 0;
    atomic_fetch_add_explicit(&tt->nsignals, 1, memory_order_relaxed);
    return 1;
}

int bt__wake_for(bt_timer_thread *tt, int64_t deadline, int collect) {
    pthread_mutex_lock(&tt->wake_mutex);
    int wake = lower_locked(tt, deadline, collect);
    pthread_mutex_unlock(&tt->wake_mutex);
    if (wake) bt__futex_wake(&tt->nsignals);
    return wake;
}

void bt__lower_nearest(bt_timer_thread *tt, int64_t deadline) {
    pthread_mutex_lock(&tt->wake_mutex);
    if (deadline < tt->nearest) tt->nearest = deadline;
    pthread_mutex_unlock(&tt->wake_mutex);
}

void bt__wake_to_stop(bt_timer_thread *tt) {
    pthread_mutex_lock(&tt->wake_mutex);
    atomic_store(&tt->stop, 1);
    atomic_fetch_add_explicit(&tt->nsignals, 1, memory_order_relaxed);
    pthread_cond_broadcast(&tt->delivered); /* nothing more is delivered */
    atomic_store(&tt->held, 0);             /* a held thread must see the stop */
    pthread_mutex_unlock(&tt->wake_mutex);
    bt__futex_wake(&tt->nsignals);
    bt__futex_wake(&tt->held);
}

/* ---- delivery on request -------------------------------------------------
 * bt_deliver_due: the caller takes a ticket and waits until a pass that
 * began after the ticket was taken has fired everything due.  Such a pass
 * collects the lists (bt__begin_pass collects while a ticket waits) and
 * reads its clock after the caller's, so it posts every timer due at the
 * caller's `now`.  No wait at all when the thread sleeps until after `now`
 * with the lists' nearest after it too: nothing due is left unposted. */

/* Under wake_mutex: nothing of the core is due at `now` and not yet
 * posted. */
static int nothing_due_locked(bt_timer_thread *tt, int64_t now) {
    return tt->asleep && tt->asleep_until > now && tt->nearest > now;
}

int bt__deliver_due(bt_timer_thread *tt, int64_t now) {
    pthread_mutex_lock(&tt->wake_mutex);
    if (atomic_load_explicit(&tt->stop, memory_order_relaxed) || nothing_due_locked(tt, now)) {
        int stopped = atomic_load_explicit(&tt->stop, memory_order_relaxed);
        pthread_mutex_unlock(&tt->wake_mutex);
        return stopped ? -ESHUTDOWN : 0;
    }
    uint64_t ticket = ++tt->deliver_asked;
    atomic_fetch_add_explicit(&tt->nsignals, 1, memory_order_relaxed);
    pthread_mutex_unlock(&tt->wake_mutex);
    bt__futex_wake(&tt->nsignals);
    pthread_mutex_lock(&tt->wake_mutex);
    while (tt->deliver_done < ticket && !atomic_load_explicit(&tt->stop, memory_order_relaxed))
        pthread_cond_wait(&tt->delivered, &tt->wake_mutex);
    int rc = tt->deliver_done < ticket ? -ESHUTDOWN : 0;
    pthread_mutex_unlock(&tt->wake_mutex);
    return rc;
}

void bt__request_collect(bt_timer_thread *tt) {
    if (!tt->opt.manual_clock) {
        bt__wake_for(tt, BT_COLLECT_NOW, 1);
        return;
    }
    /* Manual-clock mode: the calling thread collects itself.  If a
     * bt_advance is running (perhaps this very thread, in a native callback)
     * it will collect anyway: never wait for it. */
    if (pthread_mutex_trylock(&tt->advance_mutex) != 0) return;
    bt__collect_lists(tt, 1);
    bt__bump(&tt->drains, 1);
    atomic_store_explicit(&tt->heap_size, tt->heap.size, memory_order_relaxed);
    pthread_mutex_unlock(&tt->advance_mutex);
}

/* ---- the timer thread's side ---------------------------------------------- */

/* Under wake_mutex: whether the lists must be collected at `now` (one of
 * their deadlines is due, or a collect was asked for); if so the request is
 * taken. */
static int collect_requested_locked(bt_timer_thread *tt, int64_t now) {
    if (tt->nearest == BT_COLLECT_NOW) bt__bump(&tt->drains, 1);
    if (tt->nearest > now) return 0;
    tt->nearest = BT_NEVER;
    return 1;
}

/* Under wake_mutex: a delivery request is waiting. */
static int delivery_asked_locked(bt_timer_thread *tt) {
    return tt->deliver_asked != tt->deliver_done;
}

int bt__begin_pass(bt_timer_thread *tt, int *do_collect) {
    pthread_mutex_lock(&tt->wake_mutex);
    int stop = atomic_load_explicit(&tt->stop, memory_order_relaxed);
    tt->asleep = 0;
    if (!stop) {
        *do_collect = collect_requested_locked(tt, bt_now_ns());
        if (delivery_asked_locked(tt) && !*do_collect) {
            /* the lists are taken whole: their nearest is gone with them */
            *do_collect = 1;
            tt->nearest = BT_NEVER;
        }
        tt->deliver_serving = tt->deliver_asked;
        tt->signals_seen = atomic_load_explicit(&tt->nsignals, memory_order_relaxed);
    }
    pthread_mutex_unlock(&tt->wake_mutex);
    return stop;
}

void bt__end_pass(bt_timer_thread *tt, int fired_all) {
    if (!fired_all || tt->deliver_serving == tt->deliver_done) return;
    pthread_mutex_lock(&tt->wake_mutex);
    tt->deliver_done = tt->deliver_serving;
    pthread_cond_broadcast(&tt->delivered);
    pthread_mutex_unlock(&tt->wake_mutex);
}

int bt__signalled_since(bt_timer_thread *tt, int64_t now) {
    uint32_t n = atomic_load_explicit(&tt->nsignals, memory_order_relaxed);
    if (n == tt->signals_seen) return 0;
    tt->signals_seen = n;
    pthread_mutex_lock(&tt->wake_mutex);
    int do_collect = collect_requested_locked(tt, now);
    pthread_mutex_unlock(&tt->wake_mutex);
    return do_collect;
}

int bt__sleep_until(bt_timer_thread *tt, int64_t next) {
    pthread_mutex_lock(&tt->wake_mutex);
    if (tt->nearest < next) next = tt->nearest;
    uint32_t expected = atomic_load_explicit(&tt->nsignals, memory_order_relaxed);
    int stop = atomic_load_explicit(&tt->stop, memory_order_relaxed);
    int asked = delivery_asked_locked(tt);
    if (!asked) {
        tt->asleep = 1;
        tt->asleep_until = next;
    }
    pthread_mutex_unlock(&tt->wake_mutex);
    if (stop) return 1;
    if (asked) return 0; /* the next pass serves it */
    int64_t now = bt_now_ns();
    if (next > now) bt__futex_wait(&tt->nsignals, expected, next == BT_NEVER ? -1 : next - now);
    return 0;
}

int64_t bt__lists_nearest(bt_timer_thread *tt) {
    pthread_mutex_lock(&tt->wake_mutex);
    int64_t next = tt->nearest;
    pthread_mutex_unlock(&tt->wake_mutex);
    return next;
}
