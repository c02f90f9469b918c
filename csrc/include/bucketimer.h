/*
 * bucketimer.h -- the public C API of bucketimer's native timer core.
 *
 * One timer thread per bt_timer_thread keeps every pending timer.  Callers on
 * any thread schedule into a bucket chosen by their own thread (a lock, an
 * intrusive list, the bucket's nearest deadline); the timer thread swaps those
 * lists into a private 4-ary heap ordered by (deadline, sequence), and is woken
 * only when a new timer is earlier than the global nearest deadline.  A timer
 * that fires either runs a native function on the timer thread, or is posted
 * to a bt_port (a lock-free MPSC stack + eventfd + "signalled" flag) whose
 * consumer (an event loop, a dispatcher thread, a test) runs it.
 *
 * Ids are `generation << 32 | tag << 26 | slot index`; 0 is never a valid id.
 * The tag (1..63) names the core: while at most 63 cores are alive at once
 * their tags differ, and bt_cancel answers BT_UNKNOWN for another core's id.
 * (Past 63 live cores tags are shared; each core starts its generations at a
 * random value of its own, so another core's id cancels a timer only if its
 * 32-bit generation happens to be that slot's.)  Slot memory is never handed
 * back to the allocator while the bt_timer_thread exists, so a stale id is
 * always safe to pass to bt_cancel: it answers BT_UNKNOWN.
 *
 * Time is CLOCK_MONOTONIC in nanoseconds (the clock of Python's
 * time.monotonic()).  Errors are negative errno values.
 *
 * This header is also parsed by cffi's cdef: fixed-width types only, no macros
 * in prototypes, and every preprocessor line stands alone.
 */
#ifndef BUCKETIMER_H
#define BUCKETIMER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bt_timer_thread bt_timer_thread;
typedef struct bt_port bt_port;
typedef struct bt_timer bt_timer;

/* A native callback, run on the timer thread (or on the thread calling
 * bt_advance in manual-clock mode).  It must not block for long: every timer
 * behind it waits. */
typedef void (*bt_native_fn)(void *arg, uint64_t id);

/* The constants every layer shares (Python reads them from bucketimer._core
 * and bucketimer._cffi). */
enum bt_constants {
    BT_DEFAULT_BUCKETS = 13,
    BT_MAX_BUCKETS = 256,
    BT_DEFAULT_DRAIN_THRESHOLD = 4096,
    BT_MIN_DRAIN_THRESHOLD = 16,
    BT_DEFAULT_SWEEP_MIN = 4096,
    /* buckets of the lateness histogram: bucket i counts lateness in
     * [2^(i-1), 2^i) ns, bucket 0 counts lateness 0; the last one counts
     * everything longer */
    BT_HIST_BUCKETS = 48
};

/* Seconds beyond which a time is past the int64 range in ns (2^63 ns is
 * 9.22e9 s): bt_deadline_at and bt_deadline_after saturate there, to never
 * or (below minus it) as soon as possible.  A double, so a macro: cffi's
 * cdef takes no float constant and skips preprocessor lines; Python reads
 * it as bucketimer._core.SECONDS_RANGE. */
#define BT_SECONDS_RANGE 9.2e9

/* Options for bt_create.  Zero fields take the documented default; call
 * bt_options_init first. */
typedef struct bt_options {
    /* Number of buckets callers are hashed into by thread (at most
     * BT_MAX_BUCKETS).  Default BT_DEFAULT_BUCKETS. */
    uint32_t num_buckets;
    /* A bucket list longer than this wakes the timer thread to move it into
     * the heap and drop its cancelled entries.  Bounds garbage to
     * O(live timers + num_buckets * drain_threshold).  Default
     * BT_DEFAULT_DRAIN_THRESHOLD. */
    uint32_t drain_threshold;
    /* The heap is swept of cancelled entries when they are more than half of
     * it and it holds at least this many entries.  Default
     * BT_DEFAULT_SWEEP_MIN. */
    uint32_t sweep_min;
    /* Nonzero: no thread is started; time is what bt_advance says, and timers
     * fire on the thread calling bt_advance. */
    int32_t manual_clock;
    /* Initial time of the manual clock, in ns. */
    int64_t manual_start_ns;
} bt_options;

/* Results of bt_cancel and bt_postpone (non-negative); errors are negative
 * errno values. */
enum bt_cancel_result {
    BT_CANCELLED = 0, /* bt_cancel won: the timer will never run */
    BT_POSTPONED = 0, /* bt_postpone won: the timer runs at the new deadline */
    BT_TOO_LATE = 1,  /* it is posted, running or has run (or was cancelled) */
    BT_UNKNOWN = 2,   /* stale, foreign or invalid id */
    BT_EARLIER = 3    /* bt_postpone: the deadline is earlier than the timer's */
};

/* Counters, summed on read.  Exact when the core is quiescent.  Listed
 * once, as an X-macro (X(name) each), which the struct below and the Python
 * module's TimerThread.stats() are both written from.  At rest, scheduled ==
 * ran + cancelled + dropped and slots_free + slots_retired == slots. */
#define BT_STATS_COUNTERS(X)                                                   \
    X(scheduled)      /* timers scheduled */                                   \
    X(cancelled)      /* cancels that won (bt_drop_all's included) */          \
    X(postponed)      /* postpones that won */                                 \
    X(fired)          /* timers that became due and were run or posted */      \
    X(posted)         /* of those, posted to a port */                         \
    X(ran)            /* callbacks actually started (native + ports) */        \
    X(dropped)        /* posted timers a consumer took without running them */ \
    X(wakeups)        /* futex wakes issued by schedulers */                   \
    X(passes)         /* timer thread passes */                                \
    X(eventfd_writes) /* port signals actually written */                      \
    X(drains)         /* bucket-list collects asked for by a list or cancels */\
    X(sweeps)         /* heap sweeps of cancelled entries */                   \
    X(reaped)         /* cancelled entries removed by the core */              \
    X(heap_size)      /* entries in the heap now (live + dead) */              \
    X(list_size)      /* entries waiting in bucket lists now */                \
    X(dead)           /* cancelled entries not yet reaped */                   \
    X(slots)          /* slots allocated (memory never shrinks) */             \
    X(slots_free)     /* of those, free now */                                 \
    X(slots_retired)  /* retired for good: generation wrapped (1 per 2^32) */  \
    X(ports)          /* ports opened */                                       \
    X(buckets)        /* the core's number of buckets */                       \
    X(early_fires)    /* fires before their deadline (there are none) */       \
    X(lateness_sum)   /* ns of lateness of the timers in lateness_hist, each */\
                      /* counted at most 2^46 ns (the last bucket's start) */

#define BT_STATS_FIELD(name) uint64_t name;
typedef struct bt_stats {
    BT_STATS_COUNTERS(BT_STATS_FIELD)
    /* lateness (fire time - deadline) histogram (see BT_HIST_BUCKETS) */
    uint64_t lateness_hist[BT_HIST_BUCKETS];
} bt_stats;

/* ---- clock -------------------------------------------------------------- */

/* CLOCK_MONOTONIC now, in nanoseconds. */
int64_t bt_now_ns(void);
/* The timer thread's clock: the manual clock in manual mode. */
int64_t bt_time_ns(bt_timer_thread *tt);
/* A deadline in seconds on that clock (call_at's), in ns: rounded up, so a
 * timer never fires before time.monotonic() reaches it; +inf and anything
 * past the int64 range is never (INT64_MAX); -inf and anything below the
 * range, as soon as possible.  NaN is the caller's to refuse. */
int64_t bt_deadline_at(double when_s);
/* now_ns + delay_s (call_later's), in ns, rounded up and saturated to the
 * int64 range for every now_ns, negative ones included (a manual clock may
 * start anywhere): INT64_MAX is never, INT64_MIN as soon as possible. */
int64_t bt_deadline_after(int64_t now_ns, double delay_s);

/* ---- lifecycle ---------------------------------------------------------- */

void bt_options_init(bt_options *opt);
/* Creates the core and (unless manual_clock) starts its thread. */
int bt_create(const bt_options *opt, bt_timer_thread **out);
/* Stops and joins the thread; pending timers are dropped, never run.  Later
 * schedules fail with -ESHUTDOWN.  Idempotent, and safe from several threads
 * at once: every caller returns only after the thread is joined (manual
 * clock: after a bt_advance in progress has returned; no bt_advance runs a
 * pass after it).  Ports keep working for what was already posted.
 * Inside a pass of this core -- in one of its native callbacks (on its timer
 * thread, or inside its bt_advance), or in a callback of another core whose
 * bt_advance such a callback called, at any depth -- it cannot join: it
 * marks the core stopped and returns 0 at once.  No timer runs after that
 * callback returns (the rest of its pass is skipped; bt_drop_all finds what
 * was due), and the thread, which exits, is joined by the next bt_stop from
 * another thread or by bt_destroy.
 * Returns 0, or the error of a join that failed (negative errno): the thread
 * is then still counted as running, and a later bt_stop tries again. */
int bt_stop(bt_timer_thread *tt);
/* After bt_stop: every timer still PENDING or POSTED becomes CANCELLED and
 * on_drop(ctx, port, payload) is called for it (port is NULL and payload the
 * native arg for native timers), so the caller can release what the payload
 * holds.  Timers a concurrent bt_cancel wins are not reported.  Returns how
 * many were dropped, or -EBUSY if the core is not stopped. */
typedef void (*bt_drop_fn)(void *ctx, bt_port *port, void *payload);
int64_t bt_drop_all(bt_timer_thread *tt, bt_drop_fn on_drop, void *ctx);
/* Stops the core (as bt_stop) and frees everything.  The caller guarantees
 * nobody uses tt or its ports any more, and has consumed or abandoned
 * whatever its ports hold.  Inside a pass of this core (as bt_stop says) it
 * stops the core and returns 0; the timer thread (or the bt_advance further
 * down the stack) frees the core once the callback has returned, and nobody
 * may touch tt after the call.  Returns 0 (freed, or to be freed so), or
 * bt_stop's error: a core whose thread could not be joined is not freed
 * (call again). -EINVAL for NULL. */
int bt_destroy(bt_timer_thread *tt);
/* Nonzero once bt_stop was called, or if tt was created before a fork()
 * in an ancestor process (its thread does not exist here). */
int32_t bt_is_stopped(bt_timer_thread *tt);

/* ---- scheduling --------------------------------------------------------- */

/* Schedules fn(arg, id) on the timer thread at deadline_ns. */
int bt_schedule_native(bt_timer_thread *tt, int64_t deadline_ns, bt_native_fn fn, void *arg, uint64_t *out_id);
/* Schedules a post of `payload` to `port` at deadline_ns. */
int bt_schedule_port(bt_timer_thread *tt, int64_t deadline_ns, bt_port *port, void *payload, uint64_t *out_id);
/* PENDING|POSTED -> CANCELLED.  Returns a bt_cancel_result. */
int bt_cancel(bt_timer_thread *tt, uint64_t id);
/* Moves a PENDING timer to a later deadline, in place: no new slot, and no
 * cancelled entry left behind (what an idle timeout reset on every message
 * wants).  BT_POSTPONED: it runs at deadline_ns, never before; BT_TOO_LATE:
 * it is already posted or running, or was cancelled; BT_UNKNOWN: a stale
 * id (the timer ran and its slot moved on), a foreign or an invalid one;
 * BT_EARLIER: deadline_ns is before the timer's current deadline, the one
 * the last postpone that won set, whether or not the timer thread has moved
 * it yet (cancel and schedule instead).  Among equal deadlines a postponed timer keeps its
 * first schedule's place.  When several threads postpone one timer, the
 * last to win sets its deadline. */
int bt_postpone(bt_timer_thread *tt, uint64_t id, int64_t deadline_ns);
/* Manual-clock mode only: sets the clock to now_ns (never backwards) and fires
 * everything due, in (deadline, schedule order).  Returns how many fired, or a
 * negative errno: -EINVAL if tt has a real thread, -ESHUTDOWN once stopped
 * (also when a bt_stop came while it waited for another bt_advance), and
 * -EDEADLK inside a pass of this core (from one of its callbacks, at any
 * depth): a pass cannot run inside itself; that pass goes on. */
int64_t bt_advance(bt_timer_thread *tt, int64_t now_ns);
/* Deadline of the earliest live timer known to the core, or INT64_MAX.  In
 * manual-clock mode exact, from one of its own callbacks too (it then
 * answers without a lock and without collecting, so what the callback
 * scheduled still fires at the next bt_advance); with a thread, a hint. */
int64_t bt_next_deadline(bt_timer_thread *tt);

/* Delivers every port timer of tt due now: when it returns 0, each port
 * timer whose deadline had passed when it was called (and that was
 * scheduled before the call) has been posted to its port, so a consumer that
 * pops its port now finds them.  A consumer calls this before it queues work
 * of its own that must come after them (docs/design.rst, "Order on the
 * loop").  It runs the pass itself, on the calling thread, unless nothing can
 * be due (then it takes no lock); it may wait for a pass in progress on
 * another thread.  Native timers are left to the timer thread.  Call it
 * holding no lock the thread's native callbacks take.  Returns 0,
 * -ESHUTDOWN once stopped, -EDEADLK from one of tt's own native callbacks,
 * -ECHILD after fork; in manual-clock mode 0 at once (bt_advance posts what
 * it makes due). */
int bt_deliver_due(bt_timer_thread *tt);
/* Test only: while held (hold != 0) the timer thread starts no pass, as if
 * it waited for a CPU (consumers' bt_deliver_due still runs theirs).  The
 * thread looks at the hold before each pass: one it had begun to start when
 * the hold came still runs (a new thread's first, say).  bt_stop lets it
 * go.  -EINVAL in manual-clock mode. */
int bt_test_hold(bt_timer_thread *tt, int32_t hold);

void bt_get_stats(bt_timer_thread *tt, bt_stats *out);

/* What bt_foreach_pending reports of one timer: its port (NULL for a native
 * timer) and payload (the native function's argument), its id and its
 * deadline (a postpone's, if one won).  Nonzero: stop the walk. */
typedef int32_t (*bt_pending_fn)(void *ctx, bt_port *port, void *payload, uint64_t id,
                                 int64_t deadline_ns);
/* Calls fn for each timer that is PENDING or POSTED (scheduled and neither
 * run, cancelled nor dropped) when its slot is looked at: a walk over every
 * slot of the core, O(slots), taking no lock and changing nothing, for
 * introspection.  A timer scheduled, run or cancelled meanwhile may be
 * reported or not; what is reported was one timer's, read between two
 * reads of its state word that agree.  The payload is reported, never
 * owned: keeping it alive until fn uses it is the caller's business (the
 * Python module holds the GIL, without which no payload is released).
 * Returns how many were reported, -EINVAL for NULL, -ECHILD after fork. */
int64_t bt_foreach_pending(bt_timer_thread *tt, bt_pending_fn fn, void *ctx);

/* ---- ports -------------------------------------------------------------- */

/* Opens a port.  with_fd: create an eventfd
 * that becomes readable when timers are posted.  -ECHILD for a core created
 * before a fork() in an ancestor process (like every call on such a core,
 * it touches none of its locks). */
int bt_port_open(bt_timer_thread *tt, int32_t with_fd, bt_port **out);
/* Gives a port opened without an fd the fd its posts signal.  sock < 0: an
 * eventfd of its own, as with_fd makes.  sock >= 0: a socket whose peer the
 * consumer already polls and empties itself -- an asyncio loop's self-pipe;
 * the port keeps a dup of it, signals it with one zero byte and reads
 * nothing when acked, so the consumer must drain the port after its own
 * reader has emptied the socket in each poll's round, never before.
 * -EBUSY if the port has an fd, -EINVAL for a detached port or the orphan
 * port, -ECHILD after fork, or the -errno of dup or eventfd. */
int bt_port_wake_by(bt_port *port, int32_t sock);
/* The fd to poll for readability (a socket wake's: the dup), or -1. */
int32_t bt_port_fd(bt_port *port);
/* Nonzero once the port is detached (bt_port_detach). */
int32_t bt_port_detached(bt_port *port);
/* Nonzero if the port signals a socket (bt_port_wake_by). */
int32_t bt_port_wakes_socket(bt_port *port);
/* Marks the port detached and closes its fd.  When it returns, nothing will
 * ever be pushed to the port again: what the timer thread posted to it before
 * is in its queue for the consumer to take (drain it after detaching), and
 * timers that fall due for it later go to the core's orphan port (see
 * bt_orphans); nothing is ever signalled on a closed fd.  It may wait for a
 * post to this port in progress on the timer thread (one push and one fd
 * write).  Its memory lives until bt_port_retire or bt_destroy.  -EINVAL for
 * the orphan port. */
int bt_port_detach(bt_port *port);
/* The caller is done with a detached port it has drained: nothing calls
 * bt_port_* on it or schedules on it again, and none of its timers is
 * PENDING or POSTED (each was cancelled, or ran, or was released: a port
 * whose consumer holds no timer of it, after bt_port_cancel_all).  Its
 * memory is freed here if no pass is running, else by the core's next pass
 * (or by bt_destroy); what its
 * consumer counted stays in bt_get_stats.  -EBUSY if it is not detached or
 * still holds posted timers (then it lives until bt_destroy, as before),
 * -EINVAL for the orphan port, -ECHILD after fork. */
int bt_port_retire(bt_port *port);
/* Cancels every timer bound to the port that has not started: PENDING ones,
 * and POSTED ones still queued (here or, once detached, on the orphan port).
 * on_drop(ctx, port, payload) is called for each, as by bt_drop_all, from
 * the calling thread; they count as cancelled.  Meant for a port that is
 * going away: it looks at every slot of the core, O(slots).  The core may be
 * running (each cancel races fires as bt_cancel's does); a timer scheduled
 * for the port during the walk may be missed.  Returns how many, -EINVAL for
 * the orphan port, -ECHILD after fork (see bt_port_open). */
int64_t bt_port_cancel_all(bt_port *port, bt_drop_fn on_drop, void *ctx);
/* Port receiving timers whose own port was detached.  Its consumer releases
 * them without running them. */
bt_port *bt_orphans(bt_timer_thread *tt);

/* Consumer side: exactly one thread at a time may consume a port. */

/* Clears the port's signal (reads the eventfd) so that the next post writes
 * it again.  Call before popping. */
void bt_port_ack(bt_port *port);
/* Re-signals the port (used when a consumer stops early with items left). */
void bt_port_signal(bt_port *port);
/* Nonzero if bt_port_pop would return a timer. */
int32_t bt_port_has_posted(bt_port *port);
/* Next posted timer, or NULL when the port is empty.  What a port holds
 * comes out in (deadline, schedule order), whichever passes posted it. */
bt_timer *bt_port_pop(bt_port *port);
/* bt_deliver_due for a consumer of `port` that polled at `now`: if one of
 * the port's timers may be due at `now` and not yet posted (a lower bound
 * the port keeps, and the core's), runs the pass (wait: even if another
 * thread's is in progress; else -EBUSY then).  1 if it ran one, 0 if
 * nothing of the port's could be due (no lock taken, a few loads), or
 * bt_deliver_due's errors. */
int bt_port_deliver_due(bt_port *port, int64_t now, int32_t wait);
/* bt_port_pop for a consumer whose loop polled at `until` (CLOCK_MONOTONIC
 * ns) when the core's next schedule was `seq` (bt_port_next_seq): the next
 * posted timer due by then and scheduled before then, or NULL.  What it
 * leaves is popped later, in order; a consumer that stops on NULL with
 * bt_port_has_posted re-signals the port with bt_port_signal. */
bt_timer *bt_port_pop_polled(bt_port *port, int64_t until, uint64_t seq);
/* The schedule order (seq) the core gives its next timer: read at a poll,
 * it tells the timers scheduled before the poll from those after. */
uint64_t bt_port_next_seq(bt_port *port);
/* Id and payload of a popped timer. */
uint64_t bt_timer_id(bt_timer *t);
void *bt_timer_payload(bt_timer *t);
int64_t bt_timer_deadline(bt_timer *t);
/* POSTED -> RUNNING, right before the caller runs it.  1: the caller must run
 * it (its lateness is recorded now); 0: it was cancelled. */
int32_t bt_timer_claim(bt_port *port, bt_timer *t);
/* POSTED -> RUNNING without counting a run (it counts in dropped): a
 * consumer that releases a timer without running it (its loop closed) takes
 * ownership this way.  1: taken; 0: it was cancelled. */
int32_t bt_timer_take(bt_port *port, bt_timer *t);
/* Returns a popped timer's slot to the pool (RUNNING -> DONE if claimed).
 * The id becomes stale. */
void bt_timer_release(bt_port *port, bt_timer *t);

/* Convenience for tests: pops up to max timers, claims each and releases it;
 * writes the ids of those claimed (which "ran") to ids.  Returns the count. */
size_t bt_port_drain_ids(bt_port *port, uint64_t *ids, size_t max);

#ifdef __cplusplus
}
#endif

#endif /* BUCKETIMER_H */
