/*
 * stop.c -- model check: bt_stop against a schedule in flight, then the
 * drop (docs/design.rst, rule 11).
 *
 * Property: a schedule that succeeded published its timer before bt_stop
 * returned, so the bt_drop_all that follows the stop finds it, cancels it
 * and hands its port and payload to the callback; a schedule that lost the
 * race is refused (-ESHUTDOWN) and leaves the slot FREE.
 *
 * Code under test, as it is in csrc/: bt_stop with fence_buckets, and
 * bt_drop_all with bt__pool_cancel (lifecycle.c, pool.c); schedule_timer
 * with lock_with_free_slot and push_pending_locked (bucket.c);
 * bt__wake_to_stop and bt__wake_for (wake.c).  Stubbed, the OS only: the
 * futex (no thread sleeps here; stopwake.c has the timer thread's side).
 * The core's thread is not started, so bt_stop does not join.
 *
 * The core, its one slot and the schedule's take of it are oneslot.h's;
 * the drop finds the slot through the directory.
 *
 * unwind 2
 * Threads and bounds: one schedule against main's bt_stop and bt_drop_all:
 * 2 threads.
 *
 * Under SC and PSO.  The order the property needs comes from the bucket
 * mutex, which fence_buckets takes after the flag is set, not from an
 * atomic's ordering, so the mutations are steps dropped; one of them runs
 * under PSO too (sc+weak), to show the PSO run can fail.
 *
 * Mutations (tools/model_check.py applies each to a copy of csrc/; the
 * check must then fail):
 * mutation schedule-ignores-stop sc bucket.c: if (atomic_load_explicit(&tt->stop, memory_order_relaxed)) { => if (0) {
 * mutation stop-without-fence sc+weak lifecycle.c: pthread_mutex_lock(&tt->stop_mutex);\n    fence_buckets(tt); => pthread_mutex_lock(&tt->stop_mutex);
 */
#include "oneslot.h"

#include "../lifecycle.c"
#include "../wake.c"

#define DEADLINE 100

_Thread_local struct bt__pass_frame *bt__passes BT_TLS_IE;

static int payload;
static volatile int done_scheduler;
static int schedule_rc, dropped, dropped_right;
static uint64_t id;

void bt__futex_wait(_Atomic uint32_t *addr, uint32_t expected, int64_t timeout_ns) {
    (void)addr, (void)expected, (void)timeout_ns;
}

void bt__futex_wake(_Atomic uint32_t *addr) { (void)addr; }

static void on_drop(void *ctx, bt_port *p, void *arg) {
    (void)ctx;
    dropped++;
    dropped_right = p == &port && arg == &payload;
}

static void scheduler(void) {
    schedule_rc = bt_schedule_port(&core, DEADLINE, &port, &payload, &id);
    model_done(&done_scheduler);
}

int main(void) {
    oneslot_init(BT_WORD(GEN, BT_S_FREE));
__CPROVER_ASYNC_1:
    scheduler();
    int stop_rc = bt_stop(&core);
    int64_t drop_rc = bt_drop_all(&core, on_drop, NULL);
    model_join(done_scheduler);

    uint64_t w = slot.word;
    __CPROVER_assert(stop_rc == 0 && drop_rc == dropped, "the stop and the drop succeed");
    __CPROVER_assert(schedule_rc == 0 || schedule_rc == -ESHUTDOWN,
                     "a schedule succeeds or is refused as shut down");
    if (schedule_rc == 0) {
        __CPROVER_assert(dropped == 1 && w == BT_WORD(GEN, BT_S_CANCELLED),
                         "a timer scheduled before the stop is found by the drop");
        __CPROVER_assert(dropped_right, "with its port and payload");
    } else {
        __CPROVER_assert(dropped == 0 && w == BT_WORD(GEN, BT_S_FREE),
                         "a refused schedule leaves the slot free");
    }
    return 0;
}
