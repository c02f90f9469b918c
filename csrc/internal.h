/*
 * internal.h -- structures shared by the core's translation units.
 *
 * Ownership in one paragraph: a slot (struct bt_timer) belongs to the bucket
 * free list when FREE; to the bucket list and then the timer thread's heap
 * while PENDING; to the port queue and then its consumer while POSTED or
 * RUNNING.  Whoever owns a slot when it reaches a terminal state returns it to
 * a free list.  bt_cancel never frees anything: it only flips the state word,
 * so it is safe from any thread with any (even stale) id.
 */
#ifndef BT_INTERNAL_H
#define BT_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "bucketimer.h"

/* Deadlines with a meaning of their own.  BT_NEVER: no timer, or one that
 * never fires.  BT_COLLECT_NOW, as the global nearest (wake.c): "collect
 * the lists at once".  A timer's deadline can be INT64_MIN too (a manual
 * clock's bt_deadline_after, saturated); it is due at every clock reading,
 * so read as a collect request it asks for what it needs.  BT_SOONEST: a
 * deadline before any clock reading (bt_deadline_at's "as soon as
 * possible"), yet above BT_COLLECT_NOW, and far enough from the int64
 * limits that its difference with any clock reading stays in range. */
#define BT_NEVER INT64_MAX
#define BT_COLLECT_NOW INT64_MIN
#define BT_SOONEST (INT64_MIN / 2)

/* Slots live in blocks of BT_BLOCK_SLOTS; the directory has BT_MAX_BLOCKS
 * entries, so a core holds at most 2^26 (67 M) slots at once. */
#define BT_BLOCK_SHIFT 10u
#define BT_BLOCK_SLOTS (1u << BT_BLOCK_SHIFT)
#define BT_MAX_BLOCKS (1u << 16)

/* An id is `generation << 32 | tag << 26 | index` (docs/design.rst rule 1):
 * the low word, a slot's `slot` field, names the core (tag, 1..63, never 0,
 * so no id is 0) and the slot's place in the directory. */
#define BT_INDEX_BITS 26u
#define BT_INDEX_MASK ((1u << BT_INDEX_BITS) - 1u)
#define BT_TAGS 63u

/* A slot's state word: its generation in the high 32 bits, its state in the
 * low 8, and the BT_F_MOVED flag.  Every transition is a CAS on the whole
 * word, so a cancel with a stale generation can never change a reused
 * slot. */
enum bt__state {
    BT_S_FREE = 0,
    BT_S_PENDING = 1,
    BT_S_POSTED = 2,
    BT_S_RUNNING = 3,
    BT_S_DONE = 4,
    BT_S_CANCELLED = 5
};

#define BT_F_MOVED 0x100u /* PENDING, postponed to moved_to: its key is stale */

#define BT_WORD(gen, st) (((uint64_t)(gen) << 32) | (uint64_t)(st))
#define BT_WORD_GEN(w) ((uint32_t)((w) >> 32))
#define BT_WORD_STATE(w) ((uint32_t)((w)&0xffu))

/* One timer.  64 bytes: one cache line.
 *
 * target, arg and native are read by bt_drop_all before it owns the slot,
 * so they are relaxed atomics (plain moves on x86); a scheduler writes them
 * before the release store that publishes PENDING.  deadline (the key of
 * its place in the bucket list or the heap) and moved_to are written under
 * the home bucket's mutex: by the scheduler, by bt_postpone, and by the pass
 * applying a postpone; the pass and consumers read them without it. */
struct bt_timer {
    _Atomic uint64_t word;     /* see above */
    _Atomic int64_t deadline;  /* CLOCK_MONOTONIC ns: the heap key */
    uint64_t seq;              /* schedule order; breaks deadline ties */
    struct bt_timer *next;     /* bucket list, free list or port queue link */
    _Atomic(void *) target;    /* its port, or (native) its function */
    _Atomic(void *) arg;       /* the port's payload, or the function's argument */
    _Atomic int64_t moved_to;  /* the deadline a postpone set (BT_F_MOVED) */
    uint32_t slot;             /* low word of its ids: core tag << 26 | index */
    uint16_t bucket;           /* home bucket: where the slot is freed to */
    _Atomic uint16_t native;   /* target is a bt_native_fn */
};

_Static_assert(sizeof(struct bt_timer) == 64, "a slot is one cache line");

/* A PENDING timer's current deadline, given its word w: the target of a
 * postpone the pass has not applied yet, else its key.  Under its home
 * bucket's mutex, which guards both (bucket.c, "postpone"). */
static inline int64_t bt__current_deadline(struct bt_timer *t, uint64_t w) {
    return atomic_load_explicit((w & BT_F_MOVED) ? &t->moved_to : &t->deadline,
                                memory_order_relaxed);
}

/* A native function in a void * (POSIX lets function pointers round-trip
 * through one; a union says so without a cast ISO C frowns on). */
union bt__fn_ptr {
    bt_native_fn fn;
    void *p;
};

/* The port of a port timer, or NULL for a native one. */
static inline bt_port *bt__port_of(struct bt_timer *t) {
    return atomic_load_explicit(&t->native, memory_order_relaxed)
               ? NULL
               : (bt_port *)atomic_load_explicit(&t->target, memory_order_relaxed);
}

/* A bucket: what callers of one thread-hash touch.  Padded so two buckets
 * never share a cache line. */
struct bt__bucket {
    pthread_mutex_t mutex;
    struct bt_timer *head;  /* pending timers, newest first */
    uint32_t length;
    int64_t nearest;        /* earliest deadline in the list, or BT_NEVER */
    struct bt_timer *free;  /* free slots */
    uint32_t nfree;
    /* the list is pruned of cancelled entries in place when it reaches this
     * length and the timer thread has not come for it yet */
    uint32_t prune_at;
    /* counters written under the mutex */
    uint64_t scheduled;
    uint64_t reaped;
    uint64_t postponed;
    /* written by any thread whose bucket this is, relaxed atomics */
    _Atomic uint64_t cancelled;
    _Atomic uint64_t wakeups;
    char pad[64];
};

/* A heap entry: the key copied next to the pointer so sift compares never
 * chase pointers. */
struct bt__heap_entry {
    int64_t deadline;
    uint64_t seq;
    struct bt_timer *timer;
};

struct bt__heap {
    struct bt__heap_entry *v;
    size_t size;
    size_t cap;
};

struct bt_port {
    bt_timer_thread *tt;
    /* producer side: a Treiber stack, pushed a whole batch at a time */
    _Atomic(struct bt_timer *) stack;
    _Atomic int signalled;
    /* fd side, no lock (port.c): whoever pushes, writes or reads the fd
     * counts itself in `users` and then checks `detached`; detach sets
     * `detached`, waits for `users` to reach 0, and only then closes */
    _Atomic int fd;   /* the eventfd (or a loop's socket: wake_socket); -1 if none */
    int wake_socket;  /* set once, before fd: bt_port_wake_by */
    _Atomic int detached;
    _Atomic uint32_t users;
    /* a lower bound of the deadlines of its timers not yet posted: lowered
     * by a schedule, raised by bt_port_deliver_due (port.c) */
    _Atomic int64_t due_lb;
    /* consumer side, touched only by the consuming thread */
    struct bt_timer *batch; /* sorted by (deadline, seq): port.c */
    /* consumer counters: single writer, relaxed */
    _Atomic uint64_t ran;
    _Atomic uint64_t dropped; /* taken without running (bt_timer_take) */
    _Atomic uint64_t early;
    _Atomic uint64_t hist[BT_HIST_BUCKETS];
    _Atomic uint64_t late_sum; /* bt__hist_add's */
    /* timer-thread side: batch being built during a pass */
    struct bt_timer *pass_head;
    struct bt_timer *pass_tail;
    struct bt_port *pass_next;
    int in_pass;
    /* the core's list of open ports, for bt_destroy and bt_get_stats; then,
     * once retired, its list of ports to free (bt_port_retire) */
    struct bt_port *all_next;
    struct bt_port **all_pprev; /* what points at this one in the open list */
};

/* Finished slots of one bucket, given back in one lock at the end of a pass. */
struct reap_chain {
    struct bt_timer *head, *tail;
    uint32_t n;
};

struct bt_timer_thread {
    bt_options opt;
    struct bt__bucket *buckets;
    uint32_t nbuckets;

    /* what makes its ids its own (lifecycle.c, "ids") */
    uint32_t tag;      /* 1..63; distinct among up to 63 live cores */
    int tag_owned;     /* 0: every tag was taken, this one is shared */
    uint32_t gen0;     /* every slot's first generation, chosen at random */

    /* slot directory: entries published with release, read with acquire */
    _Atomic(struct bt_timer *) blocks[BT_MAX_BLOCKS];
    pthread_mutex_t pool_mutex;  /* serialises directory growth */
    _Atomic uint32_t nblocks;
    /* a block the timer thread maps and faults in as it starts, for the
     * first bucket to grow (pool.c, bt__pool_make_spare); NULL once taken */
    _Atomic(struct bt_timer *) spare;

    _Atomic uint64_t seq;

    /* the wake protocol (docs/design.rst rule 4) */
    pthread_mutex_t wake_mutex;
    int64_t nearest;              /* global nearest deadline, under wake_mutex */
    _Atomic uint32_t nsignals;    /* futex word; bumped under wake_mutex */
    _Atomic int stop;
    /* A lower bound of every pending timer's deadline: nothing can be due
     * before it.  Written under wake_mutex (lowered with `nearest`, set by
     * the end of every pass), read without a lock by a consumer that asks
     * whether something might be due (bt_port_deliver_due; wake.c). */
    _Atomic int64_t floor;
    _Atomic uint32_t held; /* futex word of bt_test_hold: 1 while held */
    /* bt_stop's join, one caller at a time (lifecycle.c, "stop, drop, destroy") */
    pthread_mutex_t stop_mutex;
    int started;         /* a thread exists and was not joined; stop_mutex */
    int destroy_later;   /* bt_destroy came from inside a pass of this core */
    pthread_t thread;
    uint64_t fork_generation;

    /* manual clock */
    _Atomic int64_t manual_now;

    /* One pass at a time, whoever runs it: the timer thread, a consumer in
     * bt_deliver_due, or bt_advance (manual clock).  The timer thread holds
     * it from the start of a pass until it has decided how long to sleep
     * (timer_thread.c says why). */
    pthread_mutex_t pass_mutex;

    /* owned by whoever holds pass_mutex; counters have one writer at a time
     * and are relaxed atomics so bt_get_stats may read them */
    struct bt__heap heap;
    struct reap_chain *chains; /* per bucket: slots to give back at pass end */
    size_t sweep_cursor;     /* SIZE_MAX: no sweep in progress */
    uint64_t sweep_dead_base; /* dead entries a finished sweep could not find */
    struct bt_port *pass_ports;
    uint32_t signals_seen;   /* nsignals when the pass last collected */
    _Atomic uint64_t fired, posted, ran_native, passes, drains, sweeps, reaped;
    _Atomic uint64_t heap_size, early_native;
    _Atomic uint64_t hist_native[BT_HIST_BUCKETS];
    _Atomic uint64_t late_sum_native;
    /* several writers */
    _Atomic uint64_t eventfd_writes;
    _Atomic uint64_t slots_retired; /* generations used up (pool.c) */
    _Atomic uint64_t consumer_reaped;

    /* ports */
    pthread_mutex_t ports_mutex;
    struct bt_port *ports;   /* open: not retired */
    uint32_t nports;         /* ever opened */
    bt_port *orphans;
    /* Retired ports (bt_port_retire), under ports_mutex: freed at the start
     * of the next pass, which adds what their consumers counted to the
     * *_native counters above (it is their one writer) and to
     * gone_dropped; `has_retired` lets a pass skip the lock. */
    struct bt_port *retired;
    _Atomic int has_retired;
    uint64_t gone_dropped; /* under ports_mutex */
};

/* The length at which a bucket's list is pruned in place (rule 5), once it
 * keeps `kept` live entries: twice that, and never below twice the drain
 * threshold, so pruning costs O(1) per schedule amortised. */
static inline uint32_t bt__prune_at(const bt_timer_thread *tt, uint32_t kept) {
    uint32_t floor = 2 * tt->opt.drain_threshold;
    return 2 * kept > floor ? 2 * kept : floor;
}

/* pool.c */
int bt__pool_init(bt_timer_thread *tt);
void bt__pool_destroy(bt_timer_thread *tt);
struct bt_timer *bt__slot(bt_timer_thread *tt, uint64_t id);
/* Grows the pool by one block, pushing the new slots on bucket b's free
 * list.  Takes the bucket mutex itself; call without it. */
int bt__pool_grow(bt_timer_thread *tt, uint32_t b);
void bt__pool_make_spare(bt_timer_thread *tt);
/* Returns a chain of finished slots (linked by ->next) to bucket b. */
void bt__pool_free_chain(bt_timer_thread *tt, uint32_t b, struct bt_timer *head,
                         struct bt_timer *tail, uint32_t n);
/* Marks a finished slot FREE with the next generation (owner only).
 * Returns 1 if the slot goes back to a free list, 0 if its generations are
 * used up and it must never be handed out again (pool.c). */
int bt__slot_retire(bt_timer_thread *tt, struct bt_timer *t);
/* Cancels every PENDING or POSTED timer bound to `port` (every one, native
 * timers too, when port is NULL), walking the whole slot directory, and
 * calls on_drop(ctx, its port, its payload) for each cancel it won.  Its
 * CAS races fires, cancels and the slot's reuse as bt_cancel's does, so it
 * may run beside a live timer thread.  Counts them in `cancelled`; returns
 * how many. */
int64_t bt__pool_cancel(bt_timer_thread *tt, const bt_port *port, bt_drop_fn on_drop, void *ctx);

/* heap.c */
/* Makes room for n more entries: 0, or -ENOMEM (the heap is unchanged). */
int bt__heap_reserve(struct bt__heap *h, size_t n);
int bt__heap_push(struct bt__heap *h, struct bt_timer *t);
struct bt_timer *bt__heap_pop(struct bt__heap *h);
static inline const struct bt__heap_entry *bt__heap_top(const struct bt__heap *h) {
    return h->size ? &h->v[0] : (const struct bt__heap_entry *)0;
}
/* Removes every entry for which dead(timer) is true, calling drop(timer,ctx)
 * on each, then restores heap order in O(n).  Returns how many it removed. */
size_t bt__heap_sweep(struct bt__heap *h, int (*dead)(struct bt_timer *),
                      void (*drop)(struct bt_timer *, void *), void *ctx);
/* Gives memory back after the heap shrank to a quarter of its capacity. */
void bt__heap_shrink(struct bt__heap *h);
/* Incremental sweep: examines at most `budget` positions from *cursor on,
 * removing dead entries in place (heap order kept at every step), and
 * returns 1 once it reached the end.  Entries that sift up past the cursor
 * are missed until the next sweep; the sweep is an optimisation, lazy
 * deletion stays correct without it. */
int bt__heap_sweep_step(struct bt__heap *h, int (*dead)(struct bt_timer *),
                        void (*drop)(struct bt_timer *, void *), void *ctx, size_t *cursor,
                        size_t budget, size_t *removed);
void bt__heap_free(struct bt__heap *h);

/* The initial-exec TLS model: in a shared object the default model calls
 * __tls_get_addr on every access (twice per schedule+cancel pair for the
 * caller's bucket); initial-exec reads a fixed offset from the thread
 * pointer (glibc keeps static TLS room for dlopen()ed objects' few bytes). */
#if defined(__GNUC__) || defined(__clang__)
#define BT_TLS_IE __attribute__((tls_model("initial-exec")))
#else
#define BT_TLS_IE
#endif

/* Once per port, not per timer: optimised for size and kept together, away
 * from the per-timer path's cache lines. */
#if defined(__GNUC__) || defined(__clang__)
#define BT_COLD __attribute__((cold))
#else
#define BT_COLD
#endif

/* lifecycle.c */
/* Failure injection for the C tests (CMakeLists.txt builds their own copy
 * of the core with BT_FAULT_INJECTION; the library Python loads has none):
 * a test stores an errno in bt__faults[point], and the next call that
 * reaches that point fails with it, once. */
enum bt__fault_point { BT_FAULT_POOL_INIT, BT_FAULT_JOIN, BT_FAULT_POINTS };
#ifdef BT_FAULT_INJECTION
extern _Atomic int bt__faults[BT_FAULT_POINTS];
static inline int bt__fault(enum bt__fault_point point) {
    return atomic_exchange(&bt__faults[point], 0);
}
#else
#define bt__fault(point) 0
#endif
extern _Atomic uint64_t bt__fork_generation; /* bumped in every fork() child */
/* Nonzero for a core inherited through fork(): its thread is gone, its
 * locks may be held by threads that are gone, and its ports' eventfds are
 * shared with the parent.  Everything refuses work then. */
static inline int bt__forked(const bt_timer_thread *tt) {
    return tt->fork_generation !=
           atomic_load_explicit(&bt__fork_generation, memory_order_relaxed);
}
/* Frees everything; the thread, if any, is joined or is the caller. */
void bt__destroy_now(bt_timer_thread *tt);
/* timer_thread.c: bt_deliver_due at `now`; without `wait`, -EBUSY rather
 * than wait for another pass. */
int bt__deliver_due(bt_timer_thread *tt, int64_t now, int wait);

/* pass.c: run under pass_mutex, by the timer thread, by a consumer in
 * bt_deliver_due, or by bt_advance in manual-clock mode */
#define BT_SWEEP_SLICE 2048    /* heap positions a sweep examines per slice */
#define BT_DEAD_POP_SLICE 2048 /* dead heap tops dropped per pass */
static inline int bt__is_cancelled(struct bt_timer *t) {
    return BT_WORD_STATE(atomic_load_explicit(&t->word, memory_order_acquire)) == BT_S_CANCELLED;
}
/* Moves every bucket list into the heap, reaping cancelled timers. */
void bt__collect(bt_timer_thread *tt);
/* bt__collect, then slots back to their buckets, then a sweep: at once
 * (sweep_now) or started for the thread to run in slices. */
void bt__collect_lists(bt_timer_thread *tt, int sweep_now);
/* One slice of a sweep in progress (budget SIZE_MAX: all of it). */
void bt__sweep_some(bt_timer_thread *tt, size_t budget);
/* Collects if asked, fires what is due at `now`; returns how many fired.
 * A consumer's pass (consumer) runs no native callback: those stay in the
 * heap for the timer thread (their contract: bucketimer.h). */
uint64_t bt__one_pass(bt_timer_thread *tt, int64_t now, int do_collect, size_t dead_budget,
                      int consumer, int *more);
/* Drops cancelled entries from the top of the heap and applies postpones
 * found there, until the top is a live timer at its true deadline (or the
 * heap is empty: NULL). */
const struct bt__heap_entry *bt__settle_top(bt_timer_thread *tt);
/* The earliest deadline of a live timer in the bucket lists, read in place
 * under each bucket's lock (a pending postpone counts at its target), or
 * BT_NEVER. */
int64_t bt__lists_next_live(bt_timer_thread *tt);
/* A cancelled slot, to its bucket at the end of the pass (ctx: the core). */
void bt__reap(struct bt_timer *t, void *ctx);
uint64_t bt__flush_reaped(bt_timer_thread *tt);

/* timer_thread.c */
void *bt__timer_thread_main(void *arg);
/* The passes this thread is inside, innermost first: its timer thread's
 * loop, and each bt_advance on the stack (a native callback of one core may
 * advance another, whose callback may call any core).  A frame lives on
 * the stack of the function that pushed it. */
struct bt__pass_frame {
    bt_timer_thread *tt;
    struct bt__pass_frame *outer;
};
extern _Thread_local struct bt__pass_frame *bt__passes BT_TLS_IE;
/* Whether this thread is inside a pass of tt, at any depth: then it must
 * not join tt's thread, wait for tt's advance, or free tt (lifecycle.c). */
static inline int bt__in_pass_of(const bt_timer_thread *tt) {
    for (const struct bt__pass_frame *f = bt__passes; f; f = f->outer)
        if (f->tt == tt) return 1;
    return 0;
}

/* port.c */
/* Pushes head..tail (newest first) onto the port and signals it; returns 0
 * without touching the port if it is detached (the caller posts the chain to
 * the orphan port instead), 1 otherwise. */
int bt__port_post(bt_port *port, struct bt_timer *head, struct bt_timer *tail);
void bt__port_free(bt_port *port);
/* Under pass_mutex, before a pass takes anything: frees the ports retired
 * before it began (bt_port_retire says why none can be in use). */
void bt__reclaim_ports(bt_timer_thread *tt);
/* Counts a timer that ran `lateness` ns late in `hist` and adds its
 * lateness to `sum` (at most 2^(BT_HIST_BUCKETS-2) ns: the last bucket's
 * start, so that no timer due "as soon as possible", whose lateness
 * saturates, wraps the sum).  Single writer, relaxed. */
void bt__hist_add(_Atomic uint64_t *hist, _Atomic uint64_t *sum, int64_t lateness);
/* A schedule of a timer for `port` at `deadline` (bt_port_deliver_due). */
void bt__port_lower_lb(bt_port *port, int64_t deadline);

/* Single-writer counter bump: a relaxed load and store, no lock prefix. */
#define BT_LOAD(x) atomic_load_explicit(&(x), memory_order_relaxed)
#define BT_STORE(x, v) atomic_store_explicit(&(x), (v), memory_order_relaxed)

static inline void bt__bump(_Atomic uint64_t *c, uint64_t n) {
    atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + n,
                          memory_order_relaxed);
}

/* now - deadline without signed overflow, saturated to the int64 range:
 * negative means early (which the core never does). */
static inline int64_t bt__lateness(int64_t now, int64_t deadline) {
    if (now >= deadline) {
        uint64_t d = (uint64_t)now - (uint64_t)deadline;
        return d > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)d;
    }
    uint64_t d = (uint64_t)deadline - (uint64_t)now;
    return d > (uint64_t)INT64_MAX ? INT64_MIN : -(int64_t)d;
}

/* wake.c: the wake protocol (rule 4), everything under wake_mutex */
/* Lowers the global nearest to `deadline` if it is earlier, or (collect)
 * asks for a collect; wakes the thread if either happened.  1 if woken. */
int bt__wake_for(bt_timer_thread *tt, int64_t deadline, int collect);
/* Lowers the global nearest without a wake (the timer thread's own). */
void bt__lower_nearest(bt_timer_thread *tt, int64_t deadline);
/* Sets the stop flag and wakes the thread. */
void bt__wake_to_stop(bt_timer_thread *tt);
/* Asks for a collect pass (a full list, or enough cancels), from any
 * thread; in manual-clock mode the caller collects. */
void bt__request_collect(bt_timer_thread *tt);
/* Any pass, under pass_mutex: whether the lists must be collected at `now`
 * (one of their deadlines is due, or a collect was asked); if so the
 * request is taken. */
int bt__collect_due(bt_timer_thread *tt, int64_t now);
/* Any pass: whether a wake since the last look asks for a collect at `now`
 * (brpc's pull_again; pass.c). */
int bt__signalled_since(bt_timer_thread *tt, int64_t now);
/* A consumer's pass, before it lets pass_mutex go: the floor from `next`,
 * the heap's top (BT_NEVER: empty). */
void bt__end_pass(bt_timer_thread *tt, int64_t next);
/* The thread, under pass_mutex, before a pass: 1 if stopped, else whether
 * to collect. */
int bt__begin_pass(bt_timer_thread *tt, int *do_collect);
/* The thread, under pass_mutex, which it lets go: sleeps until `next` (the
 * heap's top) or the global nearest if earlier, or until a wake.  1 if
 * stopped. */
int bt__sleep_until(bt_timer_thread *tt, int64_t next);
/* The global nearest deadline of the lists (a lower bound), or BT_NEVER. */
int64_t bt__lists_nearest(bt_timer_thread *tt);

/* futex.c */
void bt__futex_wait(_Atomic uint32_t *addr, uint32_t expected, int64_t timeout_ns);
void bt__futex_wake(_Atomic uint32_t *addr);

#endif
