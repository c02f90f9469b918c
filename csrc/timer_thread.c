/*
 * timer_thread.c -- the clock, the timer thread's loop (sleep on the futex
 * until the nearest deadline or an earlier schedule, then a pass) and the
 * manual clock that runs the same pass without a thread (docs/design.rst,
 * rules 4, 6 and 9).
 *
 * The loop reads the nearest deadline, the signal counter and the stop flag
 * under wake_mutex, and sleeps expecting that counter.  Every pass holds
 * pass_mutex: the thread's, a consumer's in bt_deliver_due, bt_advance's;
 * bt_next_deadline (manual clock) holds it too.  Each
 * thread keeps a stack of the passes it is inside (bt__passes), so a
 * callback that calls them on a core whose pass is below it on the stack
 * never waits for a lock its own thread holds.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
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

/* Beyond BT_SECONDS_RANGE (bucketimer.h): never, or (negative) as soon as
 * possible: BT_SOONEST (internal.h). */
int64_t bt_deadline_at(double when) {
    if (when >= BT_SECONDS_RANGE) return BT_NEVER;
    if (when <= -BT_SECONDS_RANGE) return BT_SOONEST;
    return (int64_t)ceil(when * 1e9);
}

/* now + delay saturated to the int64 range whatever the signs (a manual
 * clock may stand anywhere in it): each bound is tested on the side where
 * the subtraction cannot overflow. */
int64_t bt_deadline_after(int64_t now, double delay) {
    if (delay > BT_SECONDS_RANGE) return BT_NEVER;
    if (delay < -BT_SECONDS_RANGE) delay = -BT_SECONDS_RANGE;
    int64_t d = (int64_t)ceil(delay * 1e9); /* |d| <= 9.2e18 < 2^63 */
    if (d > 0 && now > INT64_MAX - d) return BT_NEVER;
    if (d < 0 && now < INT64_MIN - d) return INT64_MIN;
    return now + d;
}

/* The passes this thread is inside (internal.h): what a native callback that
 * stops, destroys, advances or asks the next deadline of a core needs to
 * know (lifecycle.c, and below; docs/guarantees.rst, "Calling the core from
 * its own callbacks"). */
_Thread_local struct bt__pass_frame *bt__passes BT_TLS_IE;

static void enter_pass(struct bt__pass_frame *f, bt_timer_thread *tt) {
    f->tt = tt;
    f->outer = bt__passes;
    bt__passes = f;
}

static void leave_pass(struct bt__pass_frame *f) { bt__passes = f->outer; }

/* ---- the timer thread (rule 4) -------------------------------------------
 * It collects bucket lists only when one of their deadlines is due (the
 * global nearest is a lower bound of every list's deadlines) or when a list
 * passed the drain threshold; otherwise a wake just moves its sleep earlier.
 * So a burst of schedules far in the future costs one wake, not one per
 * pass. */

/* Collects if asked, fires what is due, runs a slice of a sweep in
 * progress.  1 if more garbage work is waiting (no sleep before it). */
static int run_pass(bt_timer_thread *tt, int do_collect) {
    if (do_collect) bt__collect_lists(tt, 0);
    int more_dead = 0;
    /* The clock is read after the collect: never fire on a stale now. */
    bt__one_pass(tt, bt_now_ns(), 0, BT_DEAD_POP_SLICE, 0, &more_dead);
    if (tt->sweep_cursor == SIZE_MAX) return more_dead;
    bt__sweep_some(tt, BT_SWEEP_SLICE);
    atomic_store_explicit(&tt->heap_size, tt->heap.size, memory_order_relaxed);
    return more_dead || tt->sweep_cursor != SIZE_MAX;
}

/* Under pass_mutex, which it lets go: sleeps until the heap's top or the
 * lists' nearest deadline, or until a schedule signals an earlier one; a
 * signal that lands between reading the counter and the wait makes the wait
 * return at once.  1 if stopped. */
static int sleep_until_due(bt_timer_thread *tt) {
    const struct bt__heap_entry *top = bt__heap_top(&tt->heap);
    return bt__sleep_until(tt, top ? top->deadline : BT_NEVER);
}

/* bt_test_hold: a held thread starts no pass, as one that waits for a CPU
 * (bt__wake_to_stop lets it go). */
static void wait_while_held(bt_timer_thread *tt) {
    while (atomic_load_explicit(&tt->held, memory_order_acquire))
        bt__futex_wait(&tt->held, 1, -1);
}

int bt_test_hold(bt_timer_thread *tt, int32_t hold) {
    if (!tt || tt->opt.manual_clock) return -EINVAL;
    if (bt__forked(tt)) return -ECHILD;
    /* Under wake_mutex, where bt__wake_to_stop sets the stop flag and lets
     * the thread go: no hold lands after a stop. */
    pthread_mutex_lock(&tt->wake_mutex);
    int stopped = atomic_load_explicit(&tt->stop, memory_order_relaxed);
    if (!stopped) atomic_store_explicit(&tt->held, hold ? 1 : 0, memory_order_release);
    pthread_mutex_unlock(&tt->wake_mutex);
    if (stopped) return hold ? -ESHUTDOWN : 0;
    if (!hold) bt__futex_wake(&tt->held);
    return 0;
}

/* ---- delivery on request -------------------------------------------------
 * A consumer that must see what is due now (docs/design.rst, "Order on the
 * loop") runs a pass itself rather than wait for the thread: under
 * pass_mutex, the same collect and fire at its own clock reading, native
 * timers left to the thread.  It cannot make the thread sleep too long: the
 * thread decides its sleep under pass_mutex (above), from the heap's top and
 * the lists' nearest, and a pass only moves timers from the lists (none
 * earlier than the nearest) into the heap, or out of it. */

/* Under pass_mutex: the consumer's pass at `now`. */
static void deliver_locked(bt_timer_thread *tt, int64_t now) {
    int more;
    bt__one_pass(tt, now, bt__collect_due(tt, now), SIZE_MAX, 1, &more);
    const struct bt__heap_entry *top = bt__heap_top(&tt->heap);
    bt__end_pass(tt, top ? top->deadline : BT_NEVER);
}

int bt__deliver_due(bt_timer_thread *tt, int64_t now, int wait) {
    if (!tt) return -EINVAL;
    if (bt__forked(tt)) return -ECHILD;
    /* Manual clock: what is due was posted by the bt_advance that made it
     * due; nothing else ever fires. */
    if (tt->opt.manual_clock) return 0;
    /* One of this core's own native callbacks: its pass holds the lock. */
    if (bt__in_pass_of(tt)) return -EDEADLK;
    if (atomic_load_explicit(&tt->stop, memory_order_acquire)) return -ESHUTDOWN;
    if (atomic_load_explicit(&tt->floor, memory_order_acquire) > now) return 0;
    if (wait) pthread_mutex_lock(&tt->pass_mutex);
    else if (pthread_mutex_trylock(&tt->pass_mutex) != 0) return -EBUSY;
    /* Again under the lock: bt_stop takes it once after setting the flag,
     * so no pass begins after bt_stop returned. */
    int rc = atomic_load_explicit(&tt->stop, memory_order_relaxed) ? -ESHUTDOWN : 0;
    if (rc == 0) deliver_locked(tt, now);
    pthread_mutex_unlock(&tt->pass_mutex);
    return rc;
}

int bt_deliver_due(bt_timer_thread *tt) { return bt__deliver_due(tt, bt_now_ns(), 1); }

void *bt__timer_thread_main(void *arg) {
    bt_timer_thread *tt = arg;
    struct bt__pass_frame frame; /* every callback on this thread is inside it */
    enter_pass(&frame, tt);
#if defined(__linux__) && defined(PR_SET_TIMERSLACK)
    /* Linux lets a sleep run up to 50 us past its deadline by default, to
     * batch wakeups; that slack was most of a timer's lateness.  One
     * thread per process can afford 1 ns. */
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
#endif
    bt__pool_make_spare(tt);
    int do_collect = 0;
    for (;;) {
        wait_while_held(tt);
        pthread_mutex_lock(&tt->pass_mutex);
        if (bt__begin_pass(tt, &do_collect)) {
            pthread_mutex_unlock(&tt->pass_mutex);
            break;
        }
        /* Garbage left: the next slice comes after another look at what is
         * due, without a sleep. */
        if (run_pass(tt, do_collect)) {
            pthread_mutex_unlock(&tt->pass_mutex);
            continue;
        }
        if (sleep_until_due(tt)) break; /* (it let the lock go) */
    }
    leave_pass(&frame);
    if (tt->destroy_later) {
        /* bt_destroy came from one of our callbacks: nobody will join us. */
        pthread_detach(pthread_self());
        bt__destroy_now(tt);
    }
    return NULL;
}

/* ---- manual clock (rule 9) ------------------------------------------------ */

/* Under pass_mutex: moves the clock and runs the pass, with this thread
 * marked inside it. */
static uint64_t advance_locked(bt_timer_thread *tt, int64_t now_ns) {
    int64_t cur = atomic_load_explicit(&tt->manual_now, memory_order_relaxed);
    if (now_ns > cur) atomic_store_explicit(&tt->manual_now, now_ns, memory_order_release);
    else now_ns = cur;
    int more;
    struct bt__pass_frame frame;
    enter_pass(&frame, tt);
    uint64_t fired = bt__one_pass(tt, now_ns, 1, SIZE_MAX, 0, &more);
    leave_pass(&frame);
    return fired;
}

static int is_stopped(bt_timer_thread *tt) {
    return atomic_load_explicit(&tt->stop, memory_order_acquire);
}

int64_t bt_advance(bt_timer_thread *tt, int64_t now_ns) {
    if (!tt) return -EINVAL;
    if (!tt->opt.manual_clock) return -EINVAL;
    if (bt__forked(tt)) return -ECHILD;
    /* A callback of this core's own pass (at any depth): the lock is this
     * thread's already, and a pass cannot run inside itself. */
    if (bt__in_pass_of(tt)) return -EDEADLK;
    if (is_stopped(tt)) return -ESHUTDOWN;
    pthread_mutex_lock(&tt->pass_mutex);
    /* Again: a bt_stop may have come while we waited for the lock (from a
     * callback of the advance that held it, say).  No pass after a stop. */
    if (is_stopped(tt)) {
        pthread_mutex_unlock(&tt->pass_mutex);
        return -ESHUTDOWN;
    }
    uint64_t fired = advance_locked(tt, now_ns);
    int destroy = tt->destroy_later; /* a callback asked for it */
    pthread_mutex_unlock(&tt->pass_mutex);
    if (destroy) bt__destroy_now(tt);
    return (int64_t)fired;
}

/* Manual-clock mode, under pass_mutex: exact.  Collects, settles the
 * top, reads it. */
static int64_t next_deadline_locked(bt_timer_thread *tt) {
    bt__collect(tt);
    const struct bt__heap_entry *top = bt__settle_top(tt);
    bt__flush_reaped(tt);
    atomic_store_explicit(&tt->heap_size, tt->heap.size, memory_order_relaxed);
    return top ? top->deadline : BT_NEVER;
}

/* Manual-clock mode, from a callback of the core's own pass (this thread
 * holds pass_mutex further down its stack): exact too, without the lock
 * and without a collect, so that a timer scheduled by a callback still
 * fires at the next bt_advance, not in this one (docs/guarantees.rst,
 * "Order").  The heap's settled top, and the bucket lists read in place. */
static int64_t next_deadline_in_pass(bt_timer_thread *tt) {
    const struct bt__heap_entry *top = bt__settle_top(tt);
    int64_t next = top ? top->deadline : BT_NEVER;
    int64_t listed = bt__lists_next_live(tt);
    return listed < next ? listed : next;
}

int64_t bt_next_deadline(bt_timer_thread *tt) {
    if (!tt || bt__forked(tt)) return BT_NEVER;
    int64_t next = BT_NEVER;
    if (tt->opt.manual_clock) {
        if (bt__in_pass_of(tt)) return next_deadline_in_pass(tt);
        pthread_mutex_lock(&tt->pass_mutex);
        next = next_deadline_locked(tt);
        pthread_mutex_unlock(&tt->pass_mutex);
        return next;
    }
    return bt__lists_nearest(tt);
}
