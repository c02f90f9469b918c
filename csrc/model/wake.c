/*
 * wake.c -- model check: the wake protocol (docs/design.rst, rule 4).
 *
 * Property: a deadline earlier than the global nearest always wakes the
 * timer thread, and no wake is lost between "read the nearest and the
 * counter" and "sleep": when every thread has finished, the timer thread
 * either did not sleep, was woken, or sleeps with a timeout no later than
 * every deadline scheduled.
 *
 * Code under test: csrc/wake.c as it is (bt__wake_for on the callers' side,
 * bt__sleep_until on the thread's), with model.h's mutex.  Stubbed (the
 * OS only): the clock reads 0; the futex wait sleeps if and only if the word
 * still holds the expected value, in one step, as the kernel's does; a
 * futex wake wakes a thread that is asleep, and nobody else.
 *
 * Threads and bounds: the timer thread's one sleep (its heap's top at
 * 100 ns) against a scheduler (main()) with any deadline in [1, 200]: 2
 * threads, one call each.  A second scheduler adds nothing the first does
 * not show (wake_mutex serialises them) and triples the run time.
 *
 * Under SC and PSO.  Every order here is wake_mutex's, or the futex's own
 * check of its word, so the mutations are steps dropped; one of them runs
 * under PSO too (sc+weak), to show the PSO run can fail.
 *
 * Mutations (tools/model_check.py applies each to a copy of csrc/; the
 * check must then fail):
 * mutation no-bump sc wake.c: atomic_fetch_add_explicit(&tt->nsignals, 1, memory_order_relaxed);\n    return 1; => return 1;
 * mutation no-futex-wake sc+weak wake.c: if (wake) bt__futex_wake(&tt->nsignals); => (void)wake;
 * mutation nearest-not-lowered sc wake.c: else if (nearest < tt->nearest) tt->nearest = nearest; => else if (nearest < tt->nearest) (void)0;
 */
#include "model.h"

#include "../wake.c"

#define HEAP_TOP 100

static bt_timer_thread core;
static int asleep, woken;
static int64_t sleeps_until; /* the deadline the sleep's timeout ends at */
static volatile int done_sleeper;
static int64_t deadline;

int64_t bt_now_ns(void) { return 0; }

void bt__futex_wait(_Atomic uint32_t *addr, uint32_t expected, int64_t timeout_ns) {
    __CPROVER_atomic_begin();
    if (*addr == expected) {
        asleep = 1;
        sleeps_until = timeout_ns < 0 ? BT_NEVER : timeout_ns; /* now is 0 */
    }
    __CPROVER_atomic_end();
}

void bt__futex_wake(_Atomic uint32_t *addr) {
    (void)addr;
    __CPROVER_atomic_begin();
    if (asleep) woken = 1;
    __CPROVER_atomic_end();
}

static void sleeper(void) {
    pthread_mutex_lock(&core.pass_mutex); /* the thread decides under it */
    (void)bt__sleep_until(&core, HEAP_TOP);
    model_done(&done_sleeper);
}


int main(void) {
    core.nearest = BT_NEVER;
    deadline = nondet_int64();
    __CPROVER_assume(deadline >= 1 && deadline <= 200);
__CPROVER_ASYNC_1:
    sleeper();
    bt__wake_for(&core, deadline, 0); /* a schedule that lowered its bucket's nearest */
    model_join(done_sleeper);
    if (asleep && !woken)
        __CPROVER_assert(sleeps_until <= deadline, "a new earliest deadline wakes the thread");
    return 0;
}
