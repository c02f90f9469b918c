/*
 * port_type.c -- bucketimer._core.Port, the consumer's side of a bt_port:
 * one per event loop (its eventfd is registered with loop.add_reader) and
 * one for the dispatcher thread.  drain() acks the eventfd, takes the posted timers and,
 * right before calling each, claims it (POSTED -> RUNNING), so a cancel that
 * lands while it waits still wins (handle_type.c runs it).  Runs with the GIL,
 * in the loop's (or the dispatcher's) thread only; detach() closes the fd
 * and releases what is queued unrun (docs/design.rst, "Delivery" and rule 11).  The `draining`
 * flag keeps a second drain out while one runs (a callback's, or another
 * thread's detach while a callback has let the GIL go).
 */
#include "module.h"

#include <limits.h>
#include <time.h>

/* ---- Port --------------------------------------------------------------- */

/* Besides its fields, a port holds (for the GC) the slot's reference to
 * each of its pending Handles (module.h, `held`; handle_type.c). */
static int Port_traverse(PortObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    PORT_REFS(EXT_VISIT_REF)
    for (HandleObject *h = self->held; h; h = h->held_next) Py_VISIT(h);
    return 0;
}

/* Releases what the port holds of the core: its eventfd, and every timer
 * still bound to it (a detach drops what is queued; bt_port_cancel_all the
 * rest).  The orphan port holds none of its own.  Once. */
static void release_quietly(PortObject *self) {
    if (self->released || self->drop || !self->tt) return;
    PyObject *exc = PyErr_GetRaisedException();
    if (ext_port_release(self) < 0) PyErr_WriteUnraisable((PyObject *)self);
    PyErr_SetRaisedException(exc);
}

/* The cyclic GC found the port unreachable, and so its loop and its pending
 * Handles: their timers are cancelled (which drops the core's references,
 * breaking the cycles through them) before its fields go.  A loop's own
 * finaliser (asyncio's __del__ closes it, and its close detaches the port)
 * has usually done this already.  The TimerThread stays: the dealloc
 * retires the bt_port through it, and until then what the same collection
 * frees may still call this port, whose bt_port it keeps alive.  A
 * TimerThread in the same garbage breaks the cycle on its side. */
static int Port_clear(PortObject *self) {
    release_quietly(self);
    if (self->tt) ext_forget_port(self->tt, self);
    PORT_CLEARED_REFS(EXT_CLEAR_REF)
    return 0;
}

static void Port_dealloc(PortObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    /* Forgotten first: the record's update may run Python code (the GC),
     * and once retired the bt_port may be freed at any moment by the timer
     * thread's next pass, so nothing may find it through the TimerThread's
     * cache then. */
    if (self->tt) ext_forget_port(self->tt, self);
    /* No Handle refers to it any more (each holds it), so none of its
     * timers is pending or queued: nothing of the core's is bound to it
     * but its fd, closed by the detach.  Retired, the bt_port is freed by
     * the core's next pass (a loop per request would otherwise leave one
     * per loop until the TimerThread goes); self->port is not read after. */
    if (!self->drop && self->tt) {
        if (!self->released && !bt_port_detached(self->port)) (void)bt_port_detach(self->port);
        (void)bt_port_retire(self->port);
    }
    PORT_REFS(EXT_CLEAR_REF)
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* The clock a callback is timed on: CLOCK_MONOTONIC_COARSE, a read of the
 * kernel's last tick (its resolution, 1-4 ms, is far below any threshold
 * worth logging, and it costs a few ns where a precise read costs tens). */
static int64_t coarse_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Runs h as ext_handle_run does, and if it held this thread slow_after
 * seconds or longer, tells on_slow once it has returned (asyncio's
 * slow_callback_duration; docs/design.rst, "Delivery").  *mark is the clock
 * when the drain took h (the end of the previous callback): one read of the
 * clock per callback. */
static int run_timed(PortObject *self, HandleObject *h, PyObject *on_error, int64_t *mark) {
    PyObject *cb = Py_XNewRef(h->callback), *args = Py_XNewRef(h->args);
    int rc = ext_handle_run(h, on_error, 0);
    int64_t now = coarse_now_ns();
    double took = (double)(now - *mark) / 1e9;
    *mark = now;
    /* The callback may have set on_slow (to None, too) meanwhile. */
    PyObject *on_slow = self->on_slow;
    if (rc == 0 && cb && on_slow && on_slow != Py_None && took >= self->slow_after) {
        Py_INCREF(on_slow);
        PyObject *r = PyObject_CallFunction(on_slow, "OOdd", cb, args ? args : Py_None, took,
                                            self->slow_after);
        if (r) Py_DECREF(r);
        else PyErr_WriteUnraisable(on_slow);
        Py_DECREF(on_slow);
        *mark = coarse_now_ns(); /* the report's time is not the next callback's */
    }
    Py_XDECREF(cb);
    Py_XDECREF(args);
    return rc;
}

/* Runs every timer posted to this port.  The eventfd is acked first; a
 * timer cancelled after it was posted is released without running (its
 * cancel() already dropped the slot's reference).  If a callback raises
 * KeyboardInterrupt or SystemExit, the rest stay queued, the port is
 * signalled again, and the exception propagates, as asyncio would let it. */
static PyObject *Port_drain_impl(PortObject *self, int drop_all, int64_t until, uint64_t seq) {
    if (atomic_exchange(&self->draining, 1)) return PyLong_FromLong(0); /* re-entered */
    int drop = drop_all || self->drop;
    int timed = !drop && self->on_slow && self->on_slow != Py_None;
    int64_t mark = timed ? coarse_now_ns() : 0;
    bt_port_ack(self->port);
    long ran = 0;
    bt_timer *t;
    for (;;) {
        /* Bounded by the loop's last poll: what fell due or was scheduled
         * since, asyncio would run in the next iteration, after what this
         * one queues (docs/design.rst, "Order on the loop"). */
        int bounded = !drop && until >= 0;
        t = bounded ? bt_port_pop_polled(self->port, until, seq) : bt_port_pop(self->port);
        if (!t) {
            if (bounded && bt_port_has_posted(self->port)) bt_port_signal(self->port);
            break;
        }
        HandleObject *h = (HandleObject *)bt_timer_payload(t);
        if (!(drop ? bt_timer_take(self->port, t) : bt_timer_claim(self->port, t))) {
            bt_timer_release(self->port, t);
            continue;
        }
        /* The slot's reference to h is ours now. */
        bt_timer_release(self->port, t);
        ext_handle_unhold(h);
        /* on_error is a writable member: the callback may rebind it before
         * it raises, so the report needs a reference of its own. */
        PyObject *on_error = Py_XNewRef(self->on_error);
        int rc = timed ? run_timed(self, h, on_error, &mark) : ext_handle_run(h, on_error, drop);
        Py_XDECREF(on_error);
        Py_DECREF(h);
        ran++;
        if (rc < 0) {
            bt_port_signal(self->port);
            atomic_store(&self->draining, 0);
            return NULL;
        }
        /* A callback that detached this port (its loop closing, its
         * TimerThread closed): the rest is released unrun, as the detach
         * would have done had this drain not been running. */
        if (!drop && bt_port_fd(self->port) < 0) drop = 1;
    }
    atomic_store(&self->draining, 0);
    return PyLong_FromLong(ran);
}

/* The bound of a drain now: the time of the loop's last poll (-1: none)
 * and, in *seq, the core's next schedule order then. */
int64_t ext_port_drain_bound(PortObject *self, uint64_t *seq) {
    PollStampObject *stamp = self->stamp;
    *seq = self->polled_seq;
    return stamp && stamp->polled_ns >= 0 ? (int64_t)stamp->polled_ns : -1;
}

int ext_port_deliver_due(PortObject *self, int64_t now) {
    if (!self->port || bt_port_fd(self->port) < 0) return 0;
    int rc = bt_port_deliver_due(self->port, now, 0);
    if (rc == -EBUSY) { /* another thread's pass: wait for it without the GIL */
        bt_port *p = self->port;
        Py_INCREF(self); /* keeps the core (self->tt) while we wait */
        Py_BEGIN_ALLOW_THREADS
        rc = bt_port_deliver_due(p, now, 1);
        Py_END_ALLOW_THREADS
        Py_DECREF(self);
    }
    return rc > 0;
}

/* An int argument of drain(): -1 for None or a negative one (no bound). */
static int bound_arg(PyObject *arg, const char *name, long long *out) {
    *out = -1;
    if (arg == Py_None) return 0;
    if (!PyLong_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int or None, not %.100s", name,
                     Py_TYPE(arg)->tp_name);
        return -1;
    }
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v < 0 ? -1 : v;
    return 0;
}

static PyObject *Port_drain(PortObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 2) {
        PyErr_Format(PyExc_TypeError, "drain() takes at most 2 arguments (%zd given)", nargs);
        return NULL;
    }
    uint64_t seq = UINT64_MAX;
    long long until = nargs == 0 ? ext_port_drain_bound(self, &seq) : -1, s = -1;
    if (nargs >= 1 && bound_arg(args[0], "until", &until) < 0) return NULL;
    if (nargs == 2 && bound_arg(args[1], "seq", &s) < 0) return NULL;
    if (nargs >= 1) seq = s < 0 ? UINT64_MAX : (uint64_t)s;
    return Port_drain_impl(self, 0, (int64_t)until, seq);
}

/* Cancels the timers still bound to this port, wherever they wait (the
 * core's lists and heap, this queue, the orphans'), and releases what they
 * hold: a closed loop's timers must not keep it (through their callbacks and
 * this port) alive until their deadlines.  O(the core's slots): once per
 * loop close. */
static PyObject *Port_cancel_pending(PortObject *self, PyObject *Py_UNUSED(ignored)) {
    /* The core holds a timer of this port only while it holds its Handle:
     * none held, nothing to look for (the common loop close). */
    if (!self->tt || !self->held) return PyLong_FromLong(0);
    int64_t n = bt_port_cancel_all(self->port, ext_drop_handle, NULL);
    if (n < 0) return ext_raise_errno((int)n, "cancel_pending");
    return PyLong_FromLongLong(n);
}

/* An fd argument: an int, -1 for any negative one. */
static int fd_arg(PyObject *arg, const char *name, int *fd) {
    if (!PyLong_CheckExact(arg)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name, Py_TYPE(arg)->tp_name);
        return -1;
    }
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "%s is not an fd", name);
        return -1;
    }
    *fd = v < 0 ? -1 : (int)v;
    return 0;
}

/* _wake_by(sock=-1, peer=-1): the fd the port's posts signal, given once,
 * by the _attach that connects the port: an eventfd of its own, or a dup of
 * `sock`, the end of the loop's self-pipe that wakes it, `peer` being the
 * end its reader reads (docs/design.rst, "Waking a stock loop"). */
static PyObject *Port_wake_by(PortObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 2) {
        PyErr_Format(PyExc_TypeError, "_wake_by() takes at most 2 arguments (%zd given)", nargs);
        return NULL;
    }
    int sock = -1, peer = -1;
    if (nargs >= 1 && fd_arg(args[0], "sock", &sock) < 0) return NULL;
    if (nargs == 2 && fd_arg(args[1], "peer", &peer) < 0) return NULL;
    if (sock >= 0 && peer < 0) {
        PyErr_SetString(PyExc_ValueError, "a self-pipe wake needs the fd its reader reads");
        return NULL;
    }
    if (!self->tt) {
        PyErr_SetString(PyExc_RuntimeError, "the port is released");
        return NULL;
    }
    int rc = bt_port_wake_by(self->port, sock < 0 ? -1 : sock);
    if (rc == -EBUSY) {
        PyErr_SetString(PyExc_RuntimeError, "the port has its fd already");
        return NULL;
    }
    if (rc == -EINVAL) {
        PyErr_SetString(PyExc_RuntimeError, "the port is detached");
        return NULL;
    }
    if (rc) return ext_raise_errno(rc, "wake_by");
    self->wake_peer = sock >= 0 ? peer : -1;
    Py_RETURN_NONE;
}

static PyObject *Port_fileno(PortObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(bt_port_fd(self->port));
}

/* Closes the fd and releases whatever is queued without running it.  Timers
 * that come due later go to the core's orphan port.  A detach the core
 * refuses (the orphan port itself; a port of a core inherited through
 * fork()) raises and changes nothing: the queue is not touched. */
/* A detached port leaves its loop's PollStamp, which would otherwise hold it
 * (and its loop, in a cycle) for as long as the selector lives. */
static void unwatch(PortObject *self) {
    PollStampObject *stamp = self->stamp;
    if (!stamp) return;
    self->stamp = NULL;
    PyObject *ports = stamp->ports;
    for (Py_ssize_t i = 0; ports && i < PyList_GET_SIZE(ports); i++) {
        if (PyList_GET_ITEM(ports, i) == (PyObject *)self) {
            PyObject *exc = PyErr_GetRaisedException();
            if (PyList_SetSlice(ports, i, i + 1, NULL) < 0) PyErr_WriteUnraisable((PyObject *)self);
            PyErr_SetRaisedException(exc);
            break;
        }
    }
    Py_DECREF(stamp);
}

static PyObject *Port_detach(PortObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->tt) Py_RETURN_NONE; /* (none: a port being freed) */
    int rc = bt_port_detach(self->port);
    if (rc == -EINVAL) {
        PyErr_SetString(PyExc_ValueError, "the TimerThread's orphan port cannot be detached");
        return NULL;
    }
    if (rc) return ext_raise_errno(rc, "detach");
    unwatch(self);
    /* its drain's Handle names the loop: a closed loop is freed by its last
     * reference going, as asyncio's is (its reader's Handle goes likewise) */
    Py_CLEAR(self->wake_event);
    PyObject *r = Port_drain_impl(self, 1, -1, UINT64_MAX);
    if (!r) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

int ext_port_release(PortObject *self) {
    if (self->released) return 0;
    PyObject *r = Port_detach(self, NULL);
    if (!r) return -1;
    Py_DECREF(r);
    r = Port_cancel_pending(self, NULL);
    if (!r) return -1;
    Py_DECREF(r);
    self->released = 1;
    return 0;
}

static PyObject *Port_get_loop(PortObject *self, void *Py_UNUSED(c)) {
    return Py_NewRef(self->loop ? self->loop : Py_None); /* (NULL: a GC clear) */
}

static PyObject *Port_get_stamp(PortObject *self, void *Py_UNUSED(c)) {
    return Py_NewRef(self->stamp ? (PyObject *)self->stamp : Py_None);
}

static PyMethodDef Port_methods[] = {
    {"drain", (PyCFunction)(void (*)(void))Port_drain, METH_FASTCALL,
     "drain($self, until=<the loop's last poll>, seq=None, /)\n--\n\n"
     "Run the posted timers due by ``until`` (monotonic ns; None: all) and scheduled "
     "before ``seq`` (the core's schedule order; None: any), in (deadline, schedule) "
     "order; the rest wait for the next drain and the port is signalled again. By "
     "default, those due and scheduled by the loop's last poll (stamp), or all.  Returns "
     "how many were taken."},
    {"fileno", (PyCFunction)Port_fileno, METH_NOARGS,
     "The eventfd that becomes readable when timers are posted, the dup of the loop's "
     "self-pipe it signals (wakes_socket), or -1 (none yet, or detached)."},
    {"_wake_by", (PyCFunction)(void (*)(void))Port_wake_by, METH_FASTCALL,
     "_wake_by($self, sock=-1, peer=-1, /)\n--\n\n"
     "Give the port the fd its posts signal, once: an eventfd of its own, or a dup of "
     "``sock``, the end of a loop's self-pipe that wakes it (``peer``: the end its reader "
     "reads), signalled with a zero byte."},
    {"detach", (PyCFunction)Port_detach, METH_NOARGS,
     "Close the fd and drop queued timers without running them."},
    {"cancel_pending", (PyCFunction)Port_cancel_pending, METH_NOARGS,
     "Cancel every timer of this port not yet run, releasing what it holds; "
     "returns how many."},
    {NULL}};

static PyObject *Port_get_wakes_socket(PortObject *self, void *Py_UNUSED(c)) {
    return PyBool_FromLong(self->tt && bt_port_wakes_socket(self->port));
}

static PyGetSetDef Port_getset[] = {
    {"wakes_socket", (getter)Port_get_wakes_socket, NULL,
     "True if the port wakes its loop through the loop's self-pipe (no reader of its own).",
     NULL},
    {"loop", (getter)Port_get_loop, NULL, "The loop served (None: dispatcher).", NULL},
    {"stamp", (getter)Port_get_stamp, NULL,
     "The PollStamp of the loop's selector, whose last poll bounds drain(); or None.", NULL},
    {NULL}};

static PyMemberDef Port_members[] = {
    {"__weaklistoffset__", Py_T_PYSSIZET, offsetof(PortObject, weakreflist), Py_READONLY, NULL},
    {"on_error", Py_T_OBJECT_EX, offsetof(PortObject, on_error), 0,
     "on_error(handle, exc): called when a callback raises."},
    {"on_slow", Py_T_OBJECT_EX, offsetof(PortObject, on_slow), 0,
     "on_slow(callback, args, seconds, slow_after): called after a callback that ran "
     "slow_after seconds or longer; None (the default) times nothing."},
    {"slow_after", Py_T_DOUBLE, offsetof(PortObject, slow_after), 0,
     "The seconds a callback may run before on_slow is told."},
    {NULL}};

static PyType_Slot Port_slots[] = {
    {Py_tp_doc, "Where due timers of one loop (or the dispatcher) wait to run."},
    {Py_tp_dealloc, Port_dealloc},
    {Py_tp_traverse, Port_traverse},
    {Py_tp_clear, Port_clear},
    {Py_tp_methods, Port_methods},
    {Py_tp_getset, Port_getset},
    {Py_tp_members, Port_members},
    {0, NULL}};

PyType_Spec Port_spec = {
    .name = "bucketimer._core.Port",
    .basicsize = sizeof(PortObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Port_slots,
};

EXT_COLD PortObject *ext_port_new(TimerThreadObject *tt, bt_port *p, PyObject *loop, int drop) {
    PortObject *self = PyObject_GC_New(PortObject, tt->st->Port_Type);
    if (!self) return NULL;
    self->port = p;
    self->tt = (TimerThreadObject *)Py_NewRef(tt);
    self->loop = Py_NewRef(loop);
    self->on_error = Py_NewRef(Py_None);
    self->on_slow = Py_NewRef(Py_None);
    self->slow_after = 0.1;
    self->drop = drop;
    self->released = 0;
    atomic_init(&self->draining, 0);
    self->stamp = NULL;
    self->polled_seq = UINT64_MAX;
    self->wake_event = NULL;
    self->wake_peer = -1;
    self->held = NULL;
    self->weakreflist = NULL;
    PyObject_GC_Track(self);
    return self;
}
