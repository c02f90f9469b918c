/*
 * port.c -- where fired timers wait for the thread that runs them.
 *
 * The producer (the timer thread, once per pass) pushes a whole batch of
 * timers onto a Treiber stack with one CAS, then signals the fd unless the
 * "signalled" flag says it already is (libuv's uv_async_send; docs/design.rst
 * rule 8).  The one consumer acks the signal first, then takes the whole stack
 * with an exchange and reverses it, which gives back fire order.  Taking the
 * whole stack means no ABA: nobody ever pops a single node from it.
 *
 * Ordering argument for the flag: the producer pushes, then exchanges the flag
 * to 1; the consumer stores the flag 0, then exchanges the stack.  All four
 * are seq_cst, so if the producer saw 1 (and skipped the write) its push came
 * before the consumer's store of 0, hence before its exchange of the stack:
 * the consumer takes that batch.  Otherwise the producer writes the fd.
 *
 * The fd, without a lock.  The timer thread must never wait for a consumer
 * (a consumer can be descheduled anywhere, or stuck in a callback), so the
 * fd has no mutex: whoever is about to push to the stack, write the fd
 * (signal) or read it (ack) first counts itself in `users`, then reads
 * `detached`, and does nothing if the port is detached.  bt_port_detach
 * stores `detached`, then waits until `users` reads 0, and only then closes
 * the fd.  All four accesses are seq_cst: in their single total order either
 * a user's read of `detached` comes first, and then detach's read of `users`
 * sees that user's increment and waits for its decrement (a release, after
 * the push and the write or read), or detach's store comes first and the
 * user sees it.  Hence:
 *   - no read or write ever reaches a closed (or reused) fd number;
 *   - when bt_port_detach returns, every push the port will ever get
 *     happened before it, so a drain after detach takes them all, and the
 *     timer thread sends what falls due later to the orphan port (pass.c,
 *     flush_posts) -- nothing is left POSTED in a port nobody drains;
 *   - the timer thread takes no lock here at all: its post is one counted
 *     push (a CAS that retries only when a consumer's exchange intervened), one
 *     flag exchange and at most one write() to a nonblocking fd.  Detach may
 *     wait for the timer thread (one post) or for a consumer's ack in
 *     progress; the timer thread never waits for anyone.
 *
 * The fd is an eventfd of the port's own, or a dup of an asyncio loop's
 * self-pipe (bt_port_wake_by), which the loop's own reader empties: then
 * the consumer's drain must come after that reader in each round the
 * reader runs (docs/design.rst, "Waking a stock loop").
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

static int open_fd(bt_port *p) {
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) return -errno;
    atomic_store(&p->fd, fd);
    return 0;
}

BT_COLD int bt_port_open(bt_timer_thread *tt, int32_t with_fd, bt_port **out) {
    if (!tt || !out) return -EINVAL;
    if (bt__forked(tt)) return -ECHILD; /* ports_mutex may be held by a thread that is gone */
    bt_port *p = calloc(1, sizeof(*p));
    if (!p) return -ENOMEM;
    p->tt = tt;
    atomic_init(&p->fd, -1);
    atomic_init(&p->stack, NULL);
    atomic_init(&p->signalled, 0);
    atomic_init(&p->detached, 0);
    atomic_init(&p->users, 0);
    atomic_init(&p->due_lb, BT_NEVER);
    if (with_fd) {
        int rc = open_fd(p);
        if (rc) {
            free(p);
            return rc;
        }
    }
    pthread_mutex_lock(&tt->ports_mutex);
    p->all_next = tt->ports;
    if (p->all_next) p->all_next->all_pprev = &p->all_next;
    p->all_pprev = &tt->ports;
    tt->ports = p;
    tt->nports++;
    pthread_mutex_unlock(&tt->ports_mutex);
    *out = p;
    return 0;
}

int32_t bt_port_detached(bt_port *port) {
    return port ? atomic_load(&port->detached) : 1;
}

int32_t bt_port_wakes_socket(bt_port *port) { return port ? port->wake_socket : 0; }

int32_t bt_port_fd(bt_port *port) {
    return port ? atomic_load_explicit(&port->fd, memory_order_relaxed) : -1;
}

/* Counts the caller in the port's users; 0 (and not counted) if the port is
 * detached.  See the header comment. */
static int enter(bt_port *port) {
    atomic_fetch_add(&port->users, 1);
    if (!atomic_load(&port->detached)) return 1;
    atomic_fetch_sub_explicit(&port->users, 1, memory_order_release);
    return 0;
}

static void leave(bt_port *port) {
    atomic_fetch_sub_explicit(&port->users, 1, memory_order_release);
}

/* A socket wake: the fd is a dup of a socket whose peer the consumer polls
 * and empties by itself (an asyncio loop's self-pipe, docs/design.rst,
 * "Waking a stock loop").  A signal sends it one zero byte, which the loop's
 * own reader discards as its own wakes; an ack reads nothing.  The store of
 * the fd and the load of `signalled` below are seq_cst, as are a signal's
 * exchange of `signalled` and its load of the fd: a post that raced the fd's
 * arrival either sees the fd and writes it, or is seen here and signalled
 * again. */
BT_COLD int bt_port_wake_by(bt_port *port, int32_t sock) {
    if (!port) return -EINVAL;
    if (bt__forked(port->tt)) return -ECHILD;
    if (port == port->tt->orphans) return -EINVAL;
    if (!enter(port)) return -EINVAL;
    int rc = 0;
    if (atomic_load(&port->fd) >= 0) {
        rc = -EBUSY;
    } else if (sock >= 0) {
        int fd = fcntl(sock, F_DUPFD_CLOEXEC, 0);
        if (fd < 0) {
            rc = -errno;
        } else {
            port->wake_socket = 1;
            atomic_store(&port->fd, fd);
        }
    } else {
        rc = open_fd(port);
    }
    leave(port);
    if (rc == 0 && atomic_load(&port->signalled)) bt_port_signal(port);
    return rc;
}

static void close_fd(bt_port *port) {
    int fd = atomic_exchange(&port->fd, -1);
    if (fd >= 0) close(fd);
}

/* A user holds the count for a push, a flag exchange and at most one
 * read() or write() of the eventfd: microseconds, unless it was descheduled
 * in between.  So detach first yields (the user is running elsewhere and is
 * about done), then sleeps in steps short next to a time slice rather than
 * spin while the user waits for a CPU. */
#define WAIT_OUT_YIELDS 64
#define WAIT_OUT_SLEEP_NS (50 * 1000)

/* Waits until *count reads 0: yields first, then sleeps in short steps. */
static void wait_out(_Atomic uint32_t *count) {
    for (unsigned i = 0; atomic_load(count) != 0; i++) {
        if (i < WAIT_OUT_YIELDS) {
            sched_yield();
        } else {
            struct timespec ts = {0, WAIT_OUT_SLEEP_NS};
            nanosleep(&ts, NULL);
        }
    }
}

int bt_port_detach(bt_port *port) {
    if (!port) return -EINVAL;
    if (bt__forked(port->tt)) return -ECHILD;
    if (port == port->tt->orphans) return -EINVAL; /* where detached ports' timers go */
    atomic_store(&port->detached, 1);
    wait_out(&port->users); /* see the header comment */
    close_fd(port);
    return 0;
}

bt_port *bt_orphans(bt_timer_thread *tt) { return tt ? tt->orphans : NULL; }

/* O(slots): for a port that is going away (its loop closed), not a hot path. */
int64_t bt_port_cancel_all(bt_port *port, bt_drop_fn on_drop, void *ctx) {
    if (!port) return -EINVAL;
    bt_timer_thread *tt = port->tt;
    if (bt__forked(tt)) return -ECHILD;
    if (port == tt->orphans) return -EINVAL; /* holds no timer of its own */
    int64_t n = bt__pool_cancel(tt, port, on_drop, ctx);
    /* Rule 5: the cancelled entries are garbage in the lists and the heap. */
    if (n >= (int64_t)tt->opt.drain_threshold) bt__request_collect(tt);
    return n;
}

static void push_chain(bt_port *port, struct bt_timer *head, struct bt_timer *tail) {
    /* head..tail is in reverse fire order (newest first), as a stack wants. */
    struct bt_timer *old = atomic_load_explicit(&port->stack, memory_order_relaxed);
    do {
        tail->next = old;
    } while (!atomic_compare_exchange_weak_explicit(&port->stack, &old, head,
                                                    memory_order_seq_cst,
                                                    memory_order_relaxed));
}

/* Writes the fd unless the flag says it is already signalled.  The caller
 * is counted in the port's users. */
static int write_signal(bt_port *port) {
    if (atomic_exchange(&port->signalled, 1)) return 0; /* already signalled */
    int fd = atomic_load(&port->fd); /* seq_cst: see bt_port_wake_by */
    if (fd < 0) return 0;
    ssize_t n;
    if (port->wake_socket) {
        /* EAGAIN leaves the loop's buffer full of wakes: it wakes anyway;
         * EPIPE is a closed loop's, which runs nothing more. */
        static const char zero = 0;
        do {
            n = send(fd, &zero, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
        } while (n < 0 && errno == EINTR);
    } else {
        uint64_t one = 1;
        do {
            n = write(fd, &one, sizeof(one));
        } while (n < 0 && errno == EINTR);
    }
    atomic_fetch_add_explicit(&port->tt->eventfd_writes, 1, memory_order_relaxed);
    return 1;
}

int bt__port_post(bt_port *port, struct bt_timer *head, struct bt_timer *tail) {
    if (!enter(port)) return 0;
    push_chain(port, head, tail);
    write_signal(port);
    leave(port);
    return 1;
}

void bt_port_signal(bt_port *port) {
    if (!port || bt__forked(port->tt) || !enter(port)) return;
    atomic_store(&port->signalled, 0);
    write_signal(port);
    leave(port);
}

void bt_port_ack(bt_port *port) {
    if (!port || bt__forked(port->tt)) return;
    if (enter(port)) {
        int fd = atomic_load_explicit(&port->fd, memory_order_relaxed);
        if (fd >= 0 && !port->wake_socket) { /* a socket's reader is the loop's */
            uint64_t count; /* nonblocking: one read resets the eventfd */
            (void)!read(fd, &count, sizeof(count));
        }
        leave(port);
    }
    atomic_store(&port->signalled, 0);
}

int32_t bt_port_has_posted(bt_port *port) {
    if (bt__forked(port->tt)) return 0;
    return port->batch != NULL || atomic_load(&port->stack) != NULL;
}

/* ---- the consumer's order ---------------------------------------------------
 * A port runs what it holds in (deadline, seq) order, as asyncio's heap
 * would, however the timers reached it: each push is one pass's batch in
 * fire order, but a later pass may post an earlier deadline (a timer
 * scheduled already due while the loop's thread was busy), and a consumer's
 * bt_port_deliver_due adds its own.  So the consumer merges what it takes
 * into its batch: every push is a sorted run (natural merge sort, O(n) for
 * the usual one run). */

static inline int before(const struct bt_timer *a, const struct bt_timer *b) {
    int64_t da = BT_LOAD(a->deadline), db = BT_LOAD(b->deadline);
    return da < db || (da == db && a->seq < b->seq);
}

static struct bt_timer *merge(struct bt_timer *a, struct bt_timer *b) {
    struct bt_timer head = {0}, *tail = &head;
    while (a && b) {
        if (before(b, a)) {
            tail->next = b;
            b = b->next;
        } else {
            tail->next = a;
            a = a->next;
        }
        tail = tail->next;
    }
    tail->next = a ? a : b;
    return head.next;
}

/* Cuts the leading run (in order) off *list; returns it. */
static struct bt_timer *take_run(struct bt_timer **list) {
    struct bt_timer *run = *list, *t = run;
    while (t->next && !before(t->next, t)) t = t->next;
    *list = t->next;
    t->next = NULL;
    return run;
}

/* Sorts a list by merging its runs, left to right (stable: equal keys keep
 * their order; none are equal, seq being unique). */
static struct bt_timer *sort_runs(struct bt_timer *list) {
    struct bt_timer *sorted = NULL;
    while (list) sorted = merge(sorted, take_run(&list));
    return sorted;
}

/* Takes in what passes pushed since the last look. */
static void take_pushed(bt_port *port) {
    struct bt_timer *s = atomic_exchange(&port->stack, NULL);
    if (!s) return;
    /* reverse: the stack is newest first */
    struct bt_timer *rev = NULL;
    while (s) {
        struct bt_timer *n = s->next;
        s->next = rev;
        rev = s;
        s = n;
    }
    port->batch = merge(port->batch, sort_runs(rev));
}

bt_timer *bt_port_pop(bt_port *port) {
    if (bt__forked(port->tt)) return NULL; /* the parent's to run */
    take_pushed(port);
    struct bt_timer *t = port->batch;
    if (!t) return NULL;
    port->batch = t->next;
    t->next = NULL;
    return t;
}

/* asyncio's iteration runs what its heap held due at the poll, not what a
 * callback of the iteration armed since, already due or not: those wait in
 * the batch, in their place, for the next (docs/design.rst, "Order on the
 * loop").  O(1) but for such timers, which are passed over. */
bt_timer *bt_port_pop_polled(bt_port *port, int64_t until, uint64_t seq) {
    if (bt__forked(port->tt)) return NULL;
    take_pushed(port);
    struct bt_timer **link = &port->batch, *t;
    while ((t = *link) != NULL && BT_LOAD(t->deadline) <= until) {
        if (t->seq < seq) {
            *link = t->next;
            t->next = NULL;
            return t;
        }
        link = &t->next;
    }
    return NULL;
}

uint64_t bt_port_next_seq(bt_port *port) {
    return atomic_load_explicit(&port->tt->seq, memory_order_relaxed);
}

/* ---- a consumer's own pass ---------------------------------------------------
 * due_lb is a lower bound of the deadlines of the port's timers that have
 * not been posted: each schedule lowers it; only the pass below raises it,
 * to the floor it leaves, and with a CAS from the value it read first, so
 * a schedule's lower value in between stands. */

void bt__port_lower_lb(bt_port *port, int64_t deadline) {
    int64_t lb = atomic_load_explicit(&port->due_lb, memory_order_relaxed);
    while (deadline < lb && !atomic_compare_exchange_weak_explicit(
                                &port->due_lb, &lb, deadline, memory_order_release,
                                memory_order_relaxed)) {
    }
}

int bt_port_deliver_due(bt_port *port, int64_t now, int32_t wait) {
    if (!port) return -EINVAL;
    bt_timer_thread *tt = port->tt;
    if (bt__forked(tt)) return -ECHILD;
    int64_t lb = atomic_load_explicit(&port->due_lb, memory_order_acquire);
    if (lb > now || atomic_load_explicit(&tt->floor, memory_order_acquire) > now) return 0;
    int rc = bt__deliver_due(tt, now, wait);
    if (rc) return rc;
    int64_t floor = atomic_load_explicit(&tt->floor, memory_order_acquire);
    if (floor > lb)
        atomic_compare_exchange_strong_explicit(&port->due_lb, &lb, floor, memory_order_release,
                                                memory_order_relaxed);
    return 1;
}

uint64_t bt_timer_id(bt_timer *t) {
    uint64_t w = atomic_load_explicit(&t->word, memory_order_relaxed);
    return ((uint64_t)BT_WORD_GEN(w) << 32) | t->slot;
}

void *bt_timer_payload(bt_timer *t) { return BT_LOAD(t->arg); }

int64_t bt_timer_deadline(bt_timer *t) { return BT_LOAD(t->deadline); }

void bt__hist_add(_Atomic uint64_t *hist, _Atomic uint64_t *sum, int64_t lateness) {
    const int64_t cap = (int64_t)1 << (BT_HIST_BUCKETS - 2);
    int i = 0;
    if (lateness > 0) {
        i = 64 - __builtin_clzll((unsigned long long)lateness);
        if (i > BT_HIST_BUCKETS - 1) i = BT_HIST_BUCKETS - 1;
        bt__bump(sum, (uint64_t)(lateness < cap ? lateness : cap));
    }
    bt__bump(&hist[i], 1);
}

/* POSTED -> RUNNING: 1 if this consumer got it, 0 if a cancel won. */
static int take_posted(bt_timer *t) {
    uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);
    uint32_t gen = BT_WORD_GEN(w);
    uint64_t expected = BT_WORD(gen, BT_S_POSTED);
    return atomic_compare_exchange_strong_explicit(&t->word, &expected,
                                                   BT_WORD(gen, BT_S_RUNNING),
                                                   memory_order_acq_rel, memory_order_acquire);
}

int32_t bt_timer_claim(bt_port *port, bt_timer *t) {
    if (!take_posted(t)) return 0;
    int64_t late = bt__lateness(bt_time_ns(port->tt), BT_LOAD(t->deadline));
    if (late < 0) bt__bump(&port->early, 1);
    bt__hist_add(port->hist, &port->late_sum, late);
    bt__bump(&port->ran, 1);
    return 1;
}

int32_t bt_timer_take(bt_port *port, bt_timer *t) {
    if (!take_posted(t)) return 0;
    bt__bump(&port->dropped, 1);
    return 1;
}

void bt_timer_release(bt_port *port, bt_timer *t) {
    if (bt__forked(port->tt)) return; /* the slot is the parent's; its bucket lock may be held */
    uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);
    /* Only a cancelled timer counts as reaped: the dead-entry estimate is
     * cancels minus reaped, and must not drift on other releases. */
    if (BT_WORD_STATE(w) == BT_S_CANCELLED)
        atomic_fetch_add_explicit(&port->tt->consumer_reaped, 1, memory_order_relaxed);
    if (bt__slot_retire(port->tt, t)) bt__pool_free_chain(port->tt, t->bucket, t, t, 1);
}

size_t bt_port_drain_ids(bt_port *port, uint64_t *ids, size_t max) {
    size_t n = 0;
    bt_timer *t;
    if (!port) return 0;
    bt_port_ack(port);
    while (n < max && (t = bt_port_pop(port))) {
        uint64_t id = bt_timer_id(t);
        if (bt_timer_claim(port, t)) ids[n++] = id;
        bt_timer_release(port, t);
    }
    if (port->batch || atomic_load(&port->stack)) bt_port_signal(port);
    return n;
}

void bt__port_free(bt_port *port) {
    close_fd(port);
    free(port);
}

/* ---- the end of a port ----------------------------------------------------
 * A port's memory outlives its detach: the timer thread may be inside a
 * post to it (enter .. leave) when the detach returns, and a pass may have
 * it in its list of ports to flush (a timer of it staged, then cancelled).
 * Both happen in a pass, and passes run one at a time under pass_mutex; so
 * a retired port (taken off the open list) is freed by the next pass to
 * look, before it takes anything, when any pass that staged it has ended.
 * No later pass reaches it: nothing schedules on a port after its retire,
 * and none of its timers is PENDING or POSTED (bt_port_retire's contract),
 * so no fire stages it.  A slot freed since may still name it; only a
 * generation check reads that (pool.c), and compares the pointer without
 * following it.  `has_retired` is relaxed: a pass that misses a retire
 * leaves the port to a later one.  The retire frees it itself when it finds
 * pass_mutex free: no pass is running then, and none can start while it
 * holds the lock.  (The next pass may be far off: a core whose timers were
 * all cancelled sleeps until the first of their deadlines, and a process
 * running a loop per request would keep a port per loop until then.) */

/* Under pass_mutex (the *_native counters' one writer) and ports_mutex
 * (bt_get_stats sees the port listed or its counts added, never both). */
static void fold_counters(bt_timer_thread *tt, bt_port *p) {
    bt__bump(&tt->ran_native, BT_LOAD(p->ran));
    bt__bump(&tt->early_native, BT_LOAD(p->early));
    bt__bump(&tt->late_sum_native, BT_LOAD(p->late_sum));
    for (int i = 0; i < BT_HIST_BUCKETS; i++) bt__bump(&tt->hist_native[i], BT_LOAD(p->hist[i]));
    tt->gone_dropped += BT_LOAD(p->dropped);
}

int bt_port_retire(bt_port *port) {
    if (!port) return -EINVAL;
    bt_timer_thread *tt = port->tt;
    if (bt__forked(tt)) return -ECHILD; /* (ports_mutex: see bt_port_open) */
    if (port == tt->orphans) return -EINVAL;
    if (!atomic_load(&port->detached)) return -EBUSY;
    /* After the detach nothing more is pushed: what is queued stays. */
    if (atomic_load(&port->stack) || port->batch) return -EBUSY;
    pthread_mutex_lock(&tt->ports_mutex);
    *port->all_pprev = port->all_next;
    if (port->all_next) port->all_next->all_pprev = port->all_pprev;
    port->all_next = tt->retired;
    port->all_pprev = NULL;
    tt->retired = port;
    atomic_store_explicit(&tt->has_retired, 1, memory_order_relaxed);
    pthread_mutex_unlock(&tt->ports_mutex);
    /* (EBUSY, too, for a native callback of a pass, whose thread holds it) */
    if (pthread_mutex_trylock(&tt->pass_mutex) == 0) {
        bt__reclaim_ports(tt);
        pthread_mutex_unlock(&tt->pass_mutex);
    }
    return 0;
}

void bt__reclaim_ports(bt_timer_thread *tt) {
    if (!atomic_load_explicit(&tt->has_retired, memory_order_relaxed)) return;
    pthread_mutex_lock(&tt->ports_mutex);
    bt_port *p = tt->retired;
    tt->retired = NULL;
    atomic_store_explicit(&tt->has_retired, 0, memory_order_relaxed);
    for (bt_port *q = p; q; q = q->all_next) fold_counters(tt, q);
    pthread_mutex_unlock(&tt->ports_mutex);
    while (p) {
        bt_port *next = p->all_next;
        bt__port_free(p);
        p = next;
    }
}
