/*
 * stack.c -- model check: a port's post against its consumer's drain, the
 * "signalled" flag that lets a post skip the eventfd write (csrc/port.c's
 * header comment; docs/design.rst, rule 8).
 *
 * Property: no lost wake-up.  When both sides are done, every timer the
 * timer thread posted has been taken by a drain, or the eventfd holds a
 * signal, so the loop will drain again.  And no timer is taken twice.
 *
 * Code under test: bt__port_post (enter, push_chain's CAS loop,
 * write_signal, leave), bt_port_ack and bt_port_pop's exchange, as they are
 * in csrc/port.c; the consumer acks, then pops until the stack is empty, as
 * Port.drain does (ext/port_type.c).  Stubbed (the OS only): the eventfd's
 * read() and write(), as a count.
 *
 * The stack's links are pointers to memory threads share, which CBMC
 * refuses to store ("pointer handling for concurrency is unsound"), so in
 * this model copy the stack is a word of bits, one per timer: the push is
 * the same CAS loop that sets its batch's bit, the pop the same exchange,
 * which records what it took instead of reversing the links.  The links and
 * their reversal (fire order) are the consumer's own, single-threaded code,
 * which csrc/tests/test_order.c and test_core.c test, not this harness (a
 * one-thread CBMC run of them, three timers over three passes, ran out of
 * memory here).
 * adapt internal.h: _Atomic(struct bt_timer *) stack; => _Atomic(uintptr_t) stack;\n    uintptr_t model_taken, model_twice;
 * adapt port.c: struct bt_timer *old = atomic_load_explicit(&port->stack, memory_order_relaxed);\n    do {\n        tail->next = old;\n    } while (!atomic_compare_exchange_weak_explicit(&port->stack, &old, head, => uintptr_t old = atomic_load_explicit(&port->stack, memory_order_relaxed);\n    do {\n        (void)tail;\n    } while (!atomic_compare_exchange_weak_explicit(&port->stack, &old, old | head->slot,
 * adapt port.c: struct bt_timer *s = atomic_exchange(&port->stack, NULL); => uintptr_t bits = atomic_exchange(&port->stack, 0);\n        port->model_twice |= port->model_taken & bits;\n        port->model_taken |= bits;\n        return NULL;\n        struct bt_timer *s = NULL;
 * adapt port.c: atomic_init(&p->stack, NULL); => atomic_init(&p->stack, 0);
 * adapt port.c: return port->batch != NULL || atomic_load(&port->stack) != NULL; => return port->batch != NULL || atomic_load(&port->stack) != 0;
 *
 * Threads and bounds: the timer thread posts two batches (two passes)
 * against a consumer that drains up to twice, each time only if the
 * eventfd is signalled: 2 threads.  The flag is a store-buffer pattern
 * (the post: push, then exchange the flag; the drain: store the flag 0,
 * then exchange the stack), which only seq_cst orders.  Under PSO a drain
 * whose ack stores the flag relaxed still takes every batch while the
 * stack's exchange is seq_cst (its fence comes first), and the reverse: the
 * weak mutation below relaxes both, and only then is a wake-up lost.  The
 * post's side has no weak mutation: both its steps are read-modify-writes,
 * which CBMC's PSO never reorders (nor does an x86 or arm64 CPU reorder a
 * locked or acquire-release pair of them).
 *
 * Mutations (tools/model_check.py applies each to a copy of csrc/; the
 * check must then fail; lines with one name are one mutation):
 * mutation signal-before-push sc port.c: push_chain(port, head, tail);\n    write_signal(port); => write_signal(port);\n    push_chain(port, head, tail);
 * mutation ack-keeps-flag sc port.c: leave(port);\n    }\n    atomic_store(&port->signalled, 0); => leave(port);\n    }
 * mutation ack-relaxed weak port.c: leave(port);\n    }\n    atomic_store(&port->signalled, 0); => leave(port);\n    }\n    atomic_store_explicit(&port->signalled, 0, memory_order_relaxed);
 * mutation ack-relaxed weak port.c: uintptr_t bits = atomic_exchange(&port->stack, 0); => uintptr_t bits = atomic_exchange_explicit(&port->stack, 0, memory_order_relaxed);
 */
#include "model.h"

#include "../port.c"

#define A 1u
#define B 2u

static bt_timer_thread core;
static bt_port port;
static struct bt_timer a, b;
_Atomic uint64_t bt__fork_generation;
static int fd_count;
static volatile int done_post;

ssize_t write(int fd, const void *buf, size_t n) {
    (void)fd, (void)buf;
    __CPROVER_atomic_begin();
    fd_count++;
    __CPROVER_atomic_end();
    return (ssize_t)n;
}

ssize_t read(int fd, void *buf, size_t n) {
    (void)fd, (void)buf;
    __CPROVER_atomic_begin();
    fd_count = 0;
    __CPROVER_atomic_end();
    return (ssize_t)n;
}

/* Two passes, one fired timer each. */
static void timer_thread(void) {
    bt__port_post(&port, &a, &a);
    bt__port_post(&port, &b, &b);
    model_done(&done_post);
}

/* Port.drain: ack, then pop until empty. */
static void drain(void) {
    bt_port_ack(&port);
    while (bt_port_pop(&port)) {
    }
}

int main(void) {
    port.tt = &core;
    port.fd = 3;
    a.slot = A;
    b.slot = B;
__CPROVER_ASYNC_1:
    timer_thread();
    /* The loop: drains when the eventfd is readable, up to twice. */
    for (int i = 0; i < 2; i++) {
        int readable;
        __CPROVER_atomic_begin();
        readable = fd_count > 0;
        __CPROVER_atomic_end();
        if (!readable) break;
        drain();
    }
    model_join(done_post);

    __CPROVER_assert(!port.model_twice, "no timer is taken twice");
    __CPROVER_assert(port.model_taken == (A | B) || fd_count > 0,
                     "every posted timer is taken, or the eventfd is signalled");
    return 0;
}
