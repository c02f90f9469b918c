/*
 * bucketimer_bench.h -- what the benchmark kit needs from C.
 *
 * 1. A reference timer: the design brpc replaced.  One mutex guards one binary
 *    min-heap of (deadline, sequence) and a slot table; cancel looks the id up
 *    in the table and removes the entry from the heap at once (O(log n)); one
 *    thread waits on a condition variable (CLOCK_MONOTONIC) until the top
 *    deadline and is signalled only when a new timer becomes the top.  Every
 *    schedule and every cancel, from every thread, takes the one lock.  It is
 *    correct and complete (timers fire, cancel answers three ways like
 *    bt_cancel), so that comparing against it is fair.
 *
 * 2. Loops that run schedule+cancel pairs entirely in C, so that Python
 *    threads calling them through cffi (which releases the GIL around the
 *    call) make the cores run the timer code concurrently.
 *
 * Parsed by cffi's cdef like bucketimer.h: fixed-width types only, no macros
 * in prototypes, every preprocessor line stands alone.
 */
#ifndef BUCKETIMER_BENCH_H
#define BUCKETIMER_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "bucketimer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bt_ref_timer bt_ref_timer;

/* Creates the reference timer and starts its thread.  0 or a negative errno. */
int bt_ref_create(bt_ref_timer **out);
/* Schedules fn(arg, id) on the reference timer's thread at deadline_ns
 * (CLOCK_MONOTONIC).  Ids are `generation << 32 | slot + 1`, never 0. */
int bt_ref_schedule(bt_ref_timer *rt, int64_t deadline_ns, bt_native_fn fn, void *arg, uint64_t *out_id);
/* Removes a pending timer.  Returns BT_CANCELLED, BT_TOO_LATE (running or
 * ran) or BT_UNKNOWN (stale or invalid id), like bt_cancel. */
int bt_ref_cancel(bt_ref_timer *rt, uint64_t id);
/* Timers pending now. */
uint64_t bt_ref_pending(bt_ref_timer *rt);
/* Timers whose callback ran. */
uint64_t bt_ref_fired(bt_ref_timer *rt);
/* Stops and joins the thread (pending timers are dropped, never run) and
 * frees everything. */
void bt_ref_destroy(bt_ref_timer *rt);

/* n times: schedule a native no-op timer delay_ns from now (the clock is read
 * for every schedule, as a real caller does), then cancel it.  Returns the
 * elapsed CLOCK_MONOTONIC ns, or a negative errno if a call failed.  Run it
 * from several threads at once to measure contention. */
int64_t bt_bench_pairs(bt_timer_thread *tt, int64_t delay_ns, uint64_t n);
int64_t bt_ref_bench_pairs(bt_ref_timer *rt, int64_t delay_ns, uint64_t n);

/* The same loops behind a start gate, for several threads at once: each
 * caller increments *gate (zeroed by whoever starts them) and waits, yielding
 * the CPU, until nthreads callers have arrived; then it writes the
 * CLOCK_MONOTONIC time it starts to *start_ns (may be NULL) and runs the
 * loop.  Returns the loop's elapsed ns or a negative errno.  The gate opens
 * for all threads within microseconds, which a Python-level barrier (every
 * thread must take the GIL back to leave it) cannot promise. */
int64_t bt_bench_pairs_gated(bt_timer_thread *tt, int64_t delay_ns, uint64_t n, uint32_t *gate, uint32_t nthreads, int64_t *start_ns);
int64_t bt_ref_bench_pairs_gated(bt_ref_timer *rt, int64_t delay_ns, uint64_t n, uint32_t *gate, uint32_t nthreads, int64_t *start_ns);

/* Schedules n native no-op timers with deadlines spread evenly over
 * [now + min_delay_ns, now + max_delay_ns), writing their ids to ids (which
 * may be NULL).  Used to put pending timers in a core before timing pairs.
 * Returns 0 or a negative errno. */
int bt_bench_fill(bt_timer_thread *tt, int64_t min_delay_ns, int64_t max_delay_ns, uint64_t n, uint64_t *ids);
int bt_ref_bench_fill(bt_ref_timer *rt, int64_t min_delay_ns, int64_t max_delay_ns, uint64_t n, uint64_t *ids);

/* Cancels n ids (e.g. those bt_bench_fill wrote); returns how many it won. */
uint64_t bt_bench_cancel_all(bt_timer_thread *tt, const uint64_t *ids, uint64_t n);
uint64_t bt_ref_bench_cancel_all(bt_ref_timer *rt, const uint64_t *ids, uint64_t n);

#ifdef __cplusplus
}
#endif

#endif /* BUCKETIMER_BENCH_H */
