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
 * Detach (docs/design.rst rule 11).  A post counts itself in `posting`, then
 * reads `detached`; detach stores `detached`, then waits until `posting` reads
 * 0.  All four are seq_cst: in their single total order either the post's
 * read of `detached` comes first, and then detach's read of `posting` sees the
 * post's increment and waits for its decrement (a release, after the push and
 * the signal), or detach's store comes first and the post sees it and pushes
 * nothing.  So when bt_port_detach returns, every push the port will ever
 * get happened before: a drain after detach takes all of them, and timers
 * that fall due later go to the orphan port.  The wait is for at most one
 * push and one fd write on the timer thread.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#if defined(__linux__)
#include <sys/eventfd.h>
#define BT_HAVE_EVENTFD 1
#endif

static int open_fds(bt_port *p) {
#ifdef BT_HAVE_EVENTFD
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) return -errno;
    p->fd = p->wfd = fd;
#else
    int fds[2];
    if (pipe(fds) < 0) return -errno;
    for (int i = 0; i < 2; i++) {
        fcntl(fds[i], F_SETFL, fcntl(fds[i], F_GETFL) | O_NONBLOCK);
        fcntl(fds[i], F_SETFD, FD_CLOEXEC);
    }
    p->fd = fds[0];
    p->wfd = fds[1];
#endif
    return 0;
}

int bt_port_open(bt_timer_thread *tt, int32_t with_fd, bt_port **out) {
    if (!tt || !out) return -EINVAL;
    bt_port *p = calloc(1, sizeof(*p));
    if (!p) return -ENOMEM;
    p->tt = tt;
    p->fd = p->wfd = -1;
    atomic_init(&p->stack, NULL);
    atomic_init(&p->signalled, 0);
    atomic_init(&p->detached, 0);
    if (pthread_mutex_init(&p->fd_mutex, NULL)) {
        free(p);
        return -ENOMEM;
    }
    if (with_fd) {
        int rc = open_fds(p);
        if (rc) {
            pthread_mutex_destroy(&p->fd_mutex);
            free(p);
            return rc;
        }
    }
    pthread_mutex_lock(&tt->ports_mutex);
    p->all_next = tt->ports;
    tt->ports = p;
    tt->nports++;
    pthread_mutex_unlock(&tt->ports_mutex);
    *out = p;
    return 0;
}

int32_t bt_port_fd(bt_port *port) { return port ? port->fd : -1; }

/* Waits until *count reads 0: yields first, then sleeps in short steps. */
static void wait_out(_Atomic uint32_t *count) {
    for (unsigned i = 0; atomic_load(count) != 0; i++) {
        if (i < 64) {
            sched_yield();
        } else {
            struct timespec ts = {0, 50 * 1000};
            nanosleep(&ts, NULL);
        }
    }
}

int bt_port_detach(bt_port *port) {
    if (!port) return -EINVAL;
    if (bt__forked(port->tt)) return -ECHILD;
    if (port == port->tt->orphans) return -EINVAL; /* where detached ports' timers go */
    atomic_store(&port->detached, 1);
    wait_out(&port->posting); /* see the header comment */
    pthread_mutex_lock(&port->fd_mutex);
    if (port->fd >= 0) close(port->fd);
    if (port->wfd >= 0 && port->wfd != port->fd) close(port->wfd);
    port->fd = port->wfd = -1;
    pthread_mutex_unlock(&port->fd_mutex);
    return 0;
}

bt_port *bt_orphans(bt_timer_thread *tt) { return tt ? tt->orphans : NULL; }

static void push_chain(bt_port *port, struct bt_timer *head, struct bt_timer *tail) {
    /* head..tail is in reverse fire order (newest first), as a stack wants. */
    struct bt_timer *old = atomic_load_explicit(&port->stack, memory_order_relaxed);
    do {
        tail->next = old;
    } while (!atomic_compare_exchange_weak_explicit(&port->stack, &old, head,
                                                    memory_order_seq_cst,
                                                    memory_order_relaxed));
}

int bt__port_post(bt_port *port, struct bt_timer *head, struct bt_timer *tail) {
    atomic_fetch_add(&port->posting, 1);
    if (atomic_load(&port->detached)) {
        atomic_fetch_sub_explicit(&port->posting, 1, memory_order_release);
        return 0;
    }
    push_chain(port, head, tail);
    bt__port_signal(port);
    atomic_fetch_sub_explicit(&port->posting, 1, memory_order_release);
    return 1;
}

int bt__port_signal(bt_port *port) {
    if (atomic_exchange(&port->signalled, 1)) return 0; /* already signalled */
    int wrote = 0;
    pthread_mutex_lock(&port->fd_mutex);
    if (port->wfd >= 0) {
        uint64_t one = 1;
        ssize_t n;
        do {
#ifdef BT_HAVE_EVENTFD
            n = write(port->wfd, &one, sizeof(one));
#else
            n = write(port->wfd, "x", 1);
#endif
        } while (n < 0 && errno == EINTR);
        wrote = 1;
    }
    pthread_mutex_unlock(&port->fd_mutex);
    if (wrote) atomic_fetch_add_explicit(&port->tt->eventfd_writes, 1, memory_order_relaxed);
    return wrote;
}

void bt_port_signal(bt_port *port) {
    if (!port || bt__forked(port->tt)) return;
    atomic_store(&port->signalled, 0);
    bt__port_signal(port);
}

void bt_port_ack(bt_port *port) {
    if (!port || bt__forked(port->tt)) return;
    pthread_mutex_lock(&port->fd_mutex);
    if (port->fd >= 0) {
        char buf[64];
        /* Nonblocking: drains an eventfd in one read, a pipe in a few. */
        while (read(port->fd, buf, sizeof(buf)) > 0) {
#ifdef BT_HAVE_EVENTFD
            break;
#endif
        }
    }
    pthread_mutex_unlock(&port->fd_mutex);
    atomic_store(&port->signalled, 0);
}

bt_timer *bt_port_pop(bt_port *port) {
    if (bt__forked(port->tt)) return NULL; /* the parent's to run */
    if (!port->batch) {
        struct bt_timer *s = atomic_exchange(&port->stack, NULL);
        /* reverse: the stack is newest first */
        struct bt_timer *rev = NULL;
        while (s) {
            struct bt_timer *n = s->next;
            s->next = rev;
            rev = s;
            s = n;
        }
        port->batch = rev;
        if (!rev) return NULL;
    }
    struct bt_timer *t = port->batch;
    port->batch = t->next;
    t->next = NULL;
    return t;
}

uint64_t bt_timer_id(bt_timer *t) {
    uint64_t w = atomic_load_explicit(&t->word, memory_order_relaxed);
    return ((uint64_t)BT_WORD_GEN(w) << 32) | t->slot;
}

void *bt_timer_payload(bt_timer *t) { return BT_LOAD(t->arg); }

int64_t bt_timer_deadline(bt_timer *t) { return t->deadline; }

void bt__hist_add(_Atomic uint64_t *hist, int64_t lateness) {
    int i = 0;
    if (lateness > 0) {
        i = 64 - __builtin_clzll((unsigned long long)lateness);
        if (i > 47) i = 47;
    }
    bt__bump(&hist[i], 1);
}

int32_t bt_timer_claim(bt_port *port, bt_timer *t) {
    uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);
    uint32_t gen = BT_WORD_GEN(w);
    uint64_t expected = BT_WORD(gen, BT_S_POSTED);
    if (!atomic_compare_exchange_strong_explicit(&t->word, &expected,
                                                 BT_WORD(gen, BT_S_RUNNING),
                                                 memory_order_acq_rel,
                                                 memory_order_acquire))
        return 0;
    int64_t late = bt__lateness(bt_time_ns(port->tt), t->deadline);
    if (late < 0) bt__bump(&port->early, 1);
    bt__hist_add(port->hist, late);
    bt__bump(&port->ran, 1);
    return 1;
}

int32_t bt_timer_take(bt_port *port, bt_timer *t) {
    (void)port;
    uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);
    uint32_t gen = BT_WORD_GEN(w);
    uint64_t expected = BT_WORD(gen, BT_S_POSTED);
    return atomic_compare_exchange_strong_explicit(&t->word, &expected,
                                                   BT_WORD(gen, BT_S_RUNNING),
                                                   memory_order_acq_rel,
                                                   memory_order_acquire)
               ? 1
               : 0;
}

void bt_timer_release(bt_port *port, bt_timer *t) {
    uint64_t w = atomic_load_explicit(&t->word, memory_order_acquire);
    /* Only a cancelled timer counts as reaped: the dead-entry estimate is
     * cancels minus reaped, and must not drift on other releases. */
    if (BT_WORD_STATE(w) == BT_S_CANCELLED)
        atomic_fetch_add_explicit(&port->tt->consumer_reaped, 1, memory_order_relaxed);
    bt__slot_retire(t);
    bt__pool_free_chain(port->tt, t->bucket, t, t, 1);
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
    if (port->fd >= 0) close(port->fd);
    if (port->wfd >= 0 && port->wfd != port->fd) close(port->wfd);
    pthread_mutex_destroy(&port->fd_mutex);
    free(port);
}
