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
 *
 * Beside them, the floor: a lower bound of every pending deadline, which a
 * consumer reads without a lock to learn that nothing can be due yet
 * (bt_port_deliver_due, port.c).  Schedules lower it with the nearest; the
 * end of each pass sets it to the heap's top or the nearest, the earlier.
 */
#include <errno.h>

#include "internal.h"

/* ---- the callers' side ---------------------------------------------------- */

/* Under wake_mutex: makes `nearest` the global nearest if it is earlier, or
 * (collect) asks for a collect whatever it holds.  1 if the thread must be
 * woken; the counter is bumped, the futex wake is the caller's, unlocked.
 * The floor goes down with any deadline, whatever `nearest` holds (a collect
 * request replaces it). */
static int lower_locked(bt_timer_thread *tt, int64_t nearest, int collect) {
    if (!collect && nearest < atomic_load_explicit(&tt->floor, memory_order_relaxed))
        atomic_store_explicit(&tt->floor, nearest, memory_order_release);
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
    if (deadline < atomic_load_explicit(&tt->floor, memory_order_relaxed))
        atomic_store_explicit(&tt->floor, deadline, memory_order_release);
    pthread_mutex_unlock(&tt->wake_mutex);
}

void bt__wake_to_stop(bt_timer_thread *tt) {
    pthread_mutex_lock(&tt->wake_mutex);
    atomic_store(&tt->stop, 1);
    atomic_fetch_add_explicit(&tt->nsignals, 1, memory_order_relaxed);
    atomic_store(&tt->held, 0);             /* a held thread must see the stop */
    pthread_mutex_unlock(&tt->wake_mutex);
    bt__futex_wake(&tt->nsignals);
    bt__futex_wake(&tt->held);
}

void bt__request_collect(bt_timer_thread *tt) {
    if (!tt->opt.manual_clock) {
        bt__wake_for(tt, BT_COLLECT_NOW, 1);
        return;
    }
    /* Manual-clock mode: the calling thread collects itself.  If a
     * bt_advance is running (perhaps this very thread, in a native callback)
     * it will collect anyway: never wait for it. */
    if (pthread_mutex_trylock(&tt->pass_mutex) != 0) return;
    bt__collect_lists(tt, 1);
    bt__bump(&tt->drains, 1);
    atomic_store_explicit(&tt->heap_size, tt->heap.size, memory_order_relaxed);
    pthread_mutex_unlock(&tt->pass_mutex);
}

/* ---- every pass's side (under pass_mutex) ----------------------------------- */

/* Under wake_mutex: whether the lists must be collected at `now` (one of
 * their deadlines is due, or a collect was asked for); if so the request is
 * taken. */
static int collect_requested_locked(bt_timer_thread *tt, int64_t now) {
    if (tt->nearest == BT_COLLECT_NOW) bt__bump(&tt->drains, 1);
    if (tt->nearest > now) return 0;
    tt->nearest = BT_NEVER;
    return 1;
}

int bt__collect_due(bt_timer_thread *tt, int64_t now) {
    pthread_mutex_lock(&tt->wake_mutex);
    int do_collect = collect_requested_locked(tt, now);
    pthread_mutex_unlock(&tt->wake_mutex);
    return do_collect;
}

int bt__signalled_since(bt_timer_thread *tt, int64_t now) {
    uint32_t n = atomic_load_explicit(&tt->nsignals, memory_order_relaxed);
    if (n == tt->signals_seen) return 0;
    tt->signals_seen = n;
    return bt__collect_due(tt, now);
}

/* Under wake_mutex: the floor after a pass whose heap's top is `next`: the
 * lists' nearest is a lower bound of theirs (a collect request, which hides
 * it, gives the lowest: the thread comes at once and sets it again). */
static int64_t set_floor_locked(bt_timer_thread *tt, int64_t next) {
    if (tt->nearest < next) next = tt->nearest;
    atomic_store_explicit(&tt->floor, next, memory_order_release);
    return next;
}

void bt__end_pass(bt_timer_thread *tt, int64_t next) {
    pthread_mutex_lock(&tt->wake_mutex);
    set_floor_locked(tt, next);
    pthread_mutex_unlock(&tt->wake_mutex);
}

/* ---- the timer thread's side ------------------------------------------------- */

int bt__begin_pass(bt_timer_thread *tt, int *do_collect) {
    pthread_mutex_lock(&tt->wake_mutex);
    int stop = atomic_load_explicit(&tt->stop, memory_order_relaxed);
    if (!stop) {
        *do_collect = collect_requested_locked(tt, bt_now_ns());
        tt->signals_seen = atomic_load_explicit(&tt->nsignals, memory_order_relaxed);
    }
    pthread_mutex_unlock(&tt->wake_mutex);
    return stop;
}

/* Called with pass_mutex held, which it lets go before the wait: the heap's
 * top, the nearest and the counter are read with no other pass between the
 * thread's own and the read (timer_thread.c). */
int bt__sleep_until(bt_timer_thread *tt, int64_t next) {
    pthread_mutex_lock(&tt->wake_mutex);
    next = set_floor_locked(tt, next);
    uint32_t expected = atomic_load_explicit(&tt->nsignals, memory_order_relaxed);
    int stop = atomic_load_explicit(&tt->stop, memory_order_relaxed);
    pthread_mutex_unlock(&tt->wake_mutex);
    pthread_mutex_unlock(&tt->pass_mutex);
    if (stop) return 1;
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
