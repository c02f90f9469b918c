/*
 * stopwake.c -- model check: bt_stop against the timer thread between its
 * passes (docs/design.rst, rules 4 and 11).
 *
 * Properties, when both threads have finished:
 *   - the stop wakes the thread, whether it sleeps on the signal counter
 *     (no deadline: it would sleep for ever) or is held by bt_test_hold:
 *     it is never left asleep, which would leave bt_stop's join waiting;
 *   - no pass begins after bt_stop returned (what lets bt_stop from one of
 *     the core's own callbacks return without a join: the pass in progress
 *     is the last).
 *
 * Code under test, as it is in csrc/: bt_stop (lifecycle.c) with
 * bt__wake_to_stop, and the thread's bt__begin_pass and bt__sleep_until
 * (wake.c) and sleep_until_due (timer_thread.c).  The thread runs two
 * rounds of bt__timer_thread_main's loop without the pass itself (the
 * pass's own look at the stop flag is the thread's, single-threaded):
 * wait_while_held's loop, then under pass_mutex bt__begin_pass and
 * sleep_until_due, which lets it go; bt_stop takes pass_mutex once after
 * the stop, as it does to wait out a consumer's pass.  A hold (the
 * test hook) is in force at the start or not.  The core's thread is the
 * harness's, not started by the core, so bt_stop does not join it.
 *
 * Stubbed, the OS only: the clock reads 0 (the heap is empty); the futex
 * wait sleeps if and only if the word still holds the expected value, in
 * one step, and then either a wake ends it (the thread goes on) or it is
 * the thread's last step: a sleep that no wake ends shows at the end.  A
 * futex wake ends the sleeps on its word.  A timeout does not end a sleep:
 * the thread sleeps until its heap's top, and a stop must not wait for it.
 *
 * adapt timer_thread.c: struct timespec ts;\n    clock_gettime(CLOCK_MONOTONIC, &ts);\n    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec; => return 0;
 *
 * Threads and bounds: the timer thread, two rounds, against main's
 * bt_stop: 2 threads.
 *
 * Under SC and PSO.  Everything here is ordered by wake_mutex but the
 * held word's acquire load and the futex words' own reads, which the kernel
 * makes atomic with the sleep; the mutations are steps dropped, one of them
 * under PSO too (sc+weak), to show the PSO run can fail.
 *
 * Mutations (tools/model_check.py applies each to a copy of csrc/; the
 * check must then fail):
 * mutation stop-no-bump sc wake.c: atomic_store(&tt->stop, 1);\n    atomic_fetch_add_explicit(&tt->nsignals, 1, memory_order_relaxed); => atomic_store(&tt->stop, 1);
 * mutation stop-no-futex-wake sc+weak wake.c: bt__futex_wake(&tt->nsignals);\n    bt__futex_wake(&tt->held); => bt__futex_wake(&tt->held);
 * mutation stop-keeps-hold sc wake.c: atomic_store(&tt->held, 0); => (void)0;
 * mutation pass-ignores-stop sc wake.c: int stop = atomic_load_explicit(&tt->stop, memory_order_relaxed);\n    if (!stop) { => int stop = 0;\n    if (!stop) {
 */
#include "model.h"

#include "../lifecycle.c"
#include "../timer_thread.c"
#include "../wake.c"

static bt_timer_thread core;
static volatile int done_thread, stop_returned;
static int asleep_on_signals, asleep_on_hold, stuck, pass_after_stop;

void bt__futex_wait(_Atomic uint32_t *addr, uint32_t expected, int64_t timeout_ns) {
    (void)timeout_ns;
    int *asleep = addr == &core.held ? &asleep_on_hold : &asleep_on_signals;
    __CPROVER_atomic_begin();
    int sleeps = *addr == expected;
    if (sleeps) *asleep = 1;
    __CPROVER_atomic_end();
    if (!sleeps) return;
    if (nondet_bool()) {
        stuck = 1; /* the thread's last step */
        return;
    }
    __CPROVER_assume(!*asleep); /* woken */
}

void bt__futex_wake(_Atomic uint32_t *addr) {
    __CPROVER_atomic_begin();
    if (addr == &core.held) asleep_on_hold = 0;
    else asleep_on_signals = 0;
    __CPROVER_atomic_end();
}

/* bt__timer_thread_main's loop without the pass, two rounds; wait_while_held
 * is its loop, with a way out for the thread's last sleep. */
static void timer_thread(void) {
    int do_collect = 0;
    for (int round = 0; round < 2; round++) {
        while (atomic_load_explicit(&core.held, memory_order_acquire) && !stuck)
            bt__futex_wait(&core.held, 1, -1);
        if (stuck) break;
        int after = stop_returned; /* read first: bt_stop had returned */
        pthread_mutex_lock(&core.pass_mutex);
        if (bt__begin_pass(&core, &do_collect)) {
            pthread_mutex_unlock(&core.pass_mutex);
            break;
        }
        if (after) pass_after_stop = 1;
        if (sleep_until_due(&core) || stuck) break; /* (it let the lock go) */
    }
    model_done(&done_thread);
}

int main(void) {
    core.nearest = BT_NEVER;
    core.nbuckets = 0; /* fence_buckets has nothing to fence: no schedule here */
    core.held = nondet_bool();
__CPROVER_ASYNC_1:
    timer_thread();
    int stop_rc = bt_stop(&core);
    stop_returned = 1;
    model_join(done_thread);

    __CPROVER_assert(stop_rc == 0, "the stop succeeds");
    __CPROVER_assert(!(stuck && (asleep_on_signals || asleep_on_hold)),
                     "the stop wakes the thread");
    __CPROVER_assert(!pass_after_stop, "no pass begins after bt_stop returned");
    return 0;
}
