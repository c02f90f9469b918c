/*
 * timer_thread.c -- bucketimer._core.TimerThread: owns one bt_timer_thread; call_later/call_at.
 */
#include "module.h"

PyObject *raise_errno(int rc, const char *what) {
    if (rc == -ENOMEM) return PyErr_NoMemory();
    if (rc == -ESHUTDOWN) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is closed");
        return NULL;
    }
    if (rc == -ECHILD) {
        PyErr_SetString(PyExc_RuntimeError,
                        "TimerThread was created in a parent process; its thread does not "
                        "exist after fork()");
        return NULL;
    }
    errno = -rc;
    PyErr_Format(PyExc_OSError, "%s failed: %s", what, strerror(-rc));
    return NULL;
}

/* ---- time parsing ------------------------------------------------------- */

/* Converts a delay or deadline to a double; TypeError for non-numbers (str,
 * bytes, None, bool), ValueError for NaN. */
int to_seconds(PyObject *o, const char *what, double *out) {
    double v;
    if (PyFloat_CheckExact(o)) {
        v = PyFloat_AS_DOUBLE(o);
    } else if (PyBool_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a real number, not bool", what);
        return -1;
    } else if (PyLong_Check(o) || PyFloat_Check(o) ||
               (Py_TYPE(o)->tp_as_number && (Py_TYPE(o)->tp_as_number->nb_float ||
                                             Py_TYPE(o)->tp_as_number->nb_index))) {
        v = PyFloat_AsDouble(o);
        if (v == -1.0 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                /* A number beyond the double range (a huge int or
                 * Fraction): forever if positive, at once if negative.  If
                 * it cannot even say its sign, the OverflowError stands. */
                PyObject *exc = PyErr_GetRaisedException();
                PyObject *zero = PyLong_FromLong(0);
                int neg = zero ? PyObject_RichCompareBool(o, zero, Py_LT) : -1;
                Py_XDECREF(zero);
                if (neg < 0) {
                    PyErr_Clear();
                    PyErr_SetRaisedException(exc);
                    return -1;
                }
                Py_DECREF(exc);
                v = neg ? -INFINITY : INFINITY;
            } else {
                return -1;
            }
        }
    } else {
        PyErr_Format(PyExc_TypeError, "%s must be a real number, not %.100s", what,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    if (isnan(v)) {
        PyErr_Format(PyExc_ValueError, "%s must not be NaN", what);
        return -1;
    }
    *out = v;
    return 0;
}

/* Seconds on the monotonic clock -> ns, rounded up so that a timer never
 * fires before time.monotonic() reaches `when`.  +inf and anything past the
 * int64 range means never (INT64_MAX); -inf means as soon as possible. */
static int64_t when_to_ns(double when) {
    if (when >= 9.2e9) return INT64_MAX;
    if (when <= -9.2e9) return INT64_MIN / 2;
    return (int64_t)ceil(when * 1e9);
}

/* ---- TimerThread -------------------------------------------------------- */

static int TimerThread_init(TimerThreadObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buckets", "drain_threshold", NULL};
    unsigned int buckets = 13, drain = 4096;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|I$I:TimerThread", kwlist, &buckets, &drain))
        return -1;
    if (self->core) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is already initialised");
        return -1;
    }
    if (buckets < 1 || buckets > 256) {
        PyErr_SetString(PyExc_ValueError, "buckets must be between 1 and 256");
        return -1;
    }
    if (drain < 16) {
        PyErr_SetString(PyExc_ValueError, "drain_threshold must be at least 16");
        return -1;
    }
    PyObject *module = PyType_GetModuleByDef(Py_TYPE(self), &core_module);
    if (!module) return -1;
    self->state = get_state(module);
    bt_options opt;
    bt_options_init(&opt);
    opt.num_buckets = buckets;
    opt.drain_threshold = drain;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = bt_create(&opt, &self->core);
    Py_END_ALLOW_THREADS if (rc) {
        raise_errno(rc, "bt_create");
        return -1;
    }
    return 0;
}

static int TimerThread_traverse(TimerThreadObject *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->cached_loop);
    Py_VISIT(self->cached_port);
    Py_VISIT(self->dispatcher);
    return 0;
}

static int TimerThread_clear(TimerThreadObject *self) {
    Py_CLEAR(self->cached_loop);
    Py_CLEAR(self->cached_port);
    Py_CLEAR(self->dispatcher);
    return 0;
}

/* Stops the core and drops every pending or posted timer without running
 * it.  Returns how many were dropped. */
static int64_t close_core(TimerThreadObject *self) {
    if (!self->core || self->closed) return 0;
    self->closed = 1;
    Py_BEGIN_ALLOW_THREADS bt_stop(self->core);
    Py_END_ALLOW_THREADS return bt_drop_all(self->core, drop_handle, NULL);
}

static void TimerThread_dealloc(TimerThreadObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    TimerThread_clear(self);
    if (self->core) {
        /* No handle or port refers to us any more (they hold references),
         * so nothing is pending: stopping and freeing is safe. */
        close_core(self);
        Py_BEGIN_ALLOW_THREADS bt_destroy(self->core);
        Py_END_ALLOW_THREADS self->core = NULL;
    }
    tp->tp_free(self);
    Py_DECREF(tp);
}

int check_open(TimerThreadObject *self) {
    if (!self->core) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is not initialised");
        return -1;
    }
    if (self->closed || bt_is_stopped(self->core)) {
        raise_errno(bt_is_stopped(self->core) && !self->closed ? -ECHILD : -ESHUTDOWN, "");
        return -1;
    }
    return 0;
}

/* Finds the port for `loop` (None: the dispatcher).  New reference: once
 * the GIL is let go (an allocation can run a finalizer), another thread may
 * detach the loop's port and drop every other reference to it. */
PortObject *port_for(TimerThreadObject *self, PyObject *loop) {
#ifndef Py_GIL_DISABLED
    if (loop == self->cached_loop && self->cached_port && bt_port_fd(self->cached_port->port) >= 0)
        return (PortObject *)Py_NewRef(self->cached_port);
    if (loop == Py_None && self->dispatcher) return (PortObject *)Py_NewRef(self->dispatcher);
#endif
    PyObject *p = PyObject_CallMethodOneArg((PyObject *)self, self->state->str_port_for, loop);
    if (!p) return NULL;
    if (!Py_IS_TYPE(p, self->state->Port_Type) || ((PortObject *)p)->tt != self) {
        Py_DECREF(p);
        PyErr_SetString(PyExc_TypeError, "_port_for must return a Port of this TimerThread");
        return NULL;
    }
#ifndef Py_GIL_DISABLED
    if (loop == Py_None) {
        Py_XSETREF(self->dispatcher, (PortObject *)Py_NewRef(p));
    } else {
        Py_XSETREF(self->cached_loop, Py_NewRef(loop));
        Py_XSETREF(self->cached_port, (PortObject *)Py_NewRef(p));
    }
#endif
    return (PortObject *)p;
}


/* The argument shape every call_later/call_at shares: (time, callback,
 * *args) and the keywords context= and, where `loop` is not NULL, loop=. */
int parse_schedule_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                               int absolute, PyObject **loop, PyObject **context) {
    const char *name = absolute ? "call_at" : "call_later";
    if (nargs < 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes a %s and a callback", name,
                     absolute ? "deadline" : "delay");
        return -1;
    }
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, i);
        if (loop && PyUnicode_CompareWithASCIIString(k, "loop") == 0) *loop = args[nargs + i];
        else if (PyUnicode_CompareWithASCIIString(k, "context") == 0) *context = args[nargs + i];
        else {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", name, k);
            return -1;
        }
    }
    return 0;
}

/* call_later(delay, callback, *args, loop=None, context=None) and call_at. */
static PyObject *schedule(TimerThreadObject *self, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames, int absolute) {
    PyObject *loop = NULL, *context = NULL;
    if (parse_schedule_args(args, nargs, kwnames, absolute, &loop, &context) < 0) return NULL;
    if (check_open(self) < 0) return NULL;
    double t;
    if (to_seconds(args[0], absolute ? "when" : "delay", &t) < 0) return NULL;
    /* Where it will be delivered. */
    PyObject *resolved = NULL;
    if (loop == NULL || loop == Py_None) {
        resolved = bt_running_loop(&self->state->compat);
        if (!resolved) return NULL;
    } else {
        resolved = Py_NewRef(loop);
    }
    PyObject *h = schedule_resolved(self, absolute, t, args[1], args + 2, nargs - 2, resolved,
                                    context, 0);
    Py_DECREF(resolved);
    return h;
}

/* The common tail of every way to schedule: `t` is a parsed delay or
 * deadline, `loop` the loop it goes to (None: the dispatcher). */
/* flags for schedule_resolved */
#define SCHED_COMPAT 1  /* asyncio.TimerHandle semantics */
#define SCHED_TIMEOUT 2 /* cb is a Timeout: expire it */

PyObject *schedule_resolved(TimerThreadObject *self, int absolute, double t, PyObject *cb,
                                   PyObject *const *cbargs, Py_ssize_t ncbargs, PyObject *loop,
                                   PyObject *context, int flags) {
    const char *name = absolute ? "call_at" : "call_later";
    if (!(flags & SCHED_TIMEOUT) && !PyCallable_Check(cb)) {
        PyErr_Format(PyExc_TypeError, "callback must be callable, not %.100s", Py_TYPE(cb)->tp_name);
        return NULL;
    }
    if (context == Py_None) context = NULL;
    if (context && !PyContext_CheckExact(context)) {
        PyErr_Format(PyExc_TypeError, "context must be a contextvars.Context, not %.100s",
                     Py_TYPE(context)->tp_name);
        return NULL;
    }
    PortObject *port = port_for(self, loop);
    if (!port) return NULL;

    int64_t deadline;
    double when;
    if (absolute) {
        when = t;
        deadline = when_to_ns(t);
    } else {
        int64_t now = bt_now_ns();
        when = (double)now / 1e9 + t;
        if (t > 9.2e9) {
            deadline = INT64_MAX; /* never: and when() says so */
            when = INFINITY;
        } else {
            if (t < -9.2e9) t = -9.2e9;
            int64_t d = (int64_t)ceil(t * 1e9);
            /* saturate instead of overflowing int64 (uptime + delay) */
            deadline = d > 0 && d > INT64_MAX - now ? INT64_MAX : now + d;
        }
    }

    HandleObject *h = handle_alloc(self->state);
    if (!h) {
        Py_DECREF(port);
        return NULL;
    }
    h->tt = (TimerThreadObject *)Py_NewRef(self);
    h->port = port; /* port_for's reference */
    h->when = when;
    h->callback = Py_NewRef(cb);
    h->args = tuple_from_array(cbargs, ncbargs);
    h->compat = (flags & SCHED_COMPAT) != 0;
    h->cancel_called = 0;
    h->is_timeout = (flags & SCHED_TIMEOUT) != 0;
    /* A Timeout's expiry only calls task.cancel(): it needs no copy of the
     * context (asyncio's handle would run it in one; nothing reads it). */
    h->context = context ? Py_NewRef(context)
                 : (flags & SCHED_TIMEOUT) ? NULL : PyContext_CopyCurrent();
    atomic_init(&h->state, H_PENDING);
    h->weakreflist = NULL;
    h->id = 0;
    PyObject_GC_Track(h);
    if (!h->args || (!h->context && !(flags & SCHED_TIMEOUT))) {
        Py_DECREF(h);
        return NULL;
    }
    /* The slot's reference, handed over at schedule. */
    Py_INCREF(h);
    int rc = bt_schedule_port(self->core, deadline, port->port, h, &h->id);
    if (rc) {
        Py_DECREF(h); /* the slot's */
        atomic_store(&h->state, H_DROPPED);
        Py_DECREF(h);
        return raise_errno(rc, name);
    }
    return (PyObject *)h;
}

static PyObject *TimerThread_call_later(TimerThreadObject *self, PyObject *const *args,
                                        Py_ssize_t nargs, PyObject *kwnames) {
    return schedule(self, args, PyVectorcall_NARGS(nargs), kwnames, 0);
}

static PyObject *TimerThread_call_at(TimerThreadObject *self, PyObject *const *args,
                                     Py_ssize_t nargs, PyObject *kwnames) {
    return schedule(self, args, PyVectorcall_NARGS(nargs), kwnames, 1);
}

static PyObject *TimerThread_open_port(TimerThreadObject *self, PyObject *loop) {
    if (check_open(self) < 0) return NULL;
    bt_port *p;
    int rc = bt_port_open(self->core, 1, &p);
    if (rc) return raise_errno(rc, "bt_port_open");
    return (PyObject *)port_new(self, p, loop, 0);
}

static PyObject *TimerThread_orphans(TimerThreadObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->core) return raise_errno(-EINVAL, "orphans");
    return (PyObject *)port_new(self, bt_orphans(self->core), Py_None, 1);
}

static PyObject *TimerThread_close_core(TimerThreadObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->core) Py_RETURN_NONE;
    int64_t n = close_core(self);
    Py_CLEAR(self->cached_loop);
    Py_CLEAR(self->cached_port);
    return PyLong_FromLongLong(n);
}

static PyObject *TimerThread_get_closed(TimerThreadObject *self, void *Py_UNUSED(c)) {
    return PyBool_FromLong(!self->core || self->closed || bt_is_stopped(self->core));
}

static PyObject *TimerThread_time(TimerThreadObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored)) {
    return PyFloat_FromDouble((double)bt_now_ns() / 1e9);
}

static PyObject *TimerThread_stats(TimerThreadObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->core) return PyDict_New();
    bt_stats s;
    Py_BEGIN_ALLOW_THREADS bt_get_stats(self->core, &s);
    Py_END_ALLOW_THREADS PyObject *hist = PyList_New(48);
    if (!hist) return NULL;
    for (int i = 0; i < 48; i++) PyList_SET_ITEM(hist, i, PyLong_FromUnsignedLongLong(s.lateness_hist[i]));
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsNsIsKsK}", "scheduled", s.scheduled, "cancelled",
        s.cancelled, "fired", s.fired, "posted", s.posted, "ran", s.ran, "wakeups", s.wakeups,
        "passes", s.passes, "eventfd_writes", s.eventfd_writes, "drains", s.drains, "sweeps",
        s.sweeps, "reaped", s.reaped, "heap_size", s.heap_size, "list_size", s.list_size, "dead",
        s.dead, "slots", s.slots, "slots_free", s.slots_free, "ports", s.ports, "early_fires",
        s.early_fires, "lateness_hist", hist, "buckets", (unsigned int)0, "slots_retired",
        s.slots_retired, "dropped", s.dropped);
}

static PyMethodDef TimerThread_methods[] = {
    {"call_later", (PyCFunction)(void (*)(void))TimerThread_call_later,
     METH_FASTCALL | METH_KEYWORDS,
     "call_later(delay, callback, *args, loop=None, context=None) -> Handle\n\n"
     "Run callback(*args) after delay seconds.  Inside a running event loop (or with loop=) it "
     "runs in that loop's thread; otherwise on this TimerThread's dispatcher thread."},
    {"call_at", (PyCFunction)(void (*)(void))TimerThread_call_at, METH_FASTCALL | METH_KEYWORDS,
     "call_at(when, callback, *args, loop=None, context=None) -> Handle\n\n"
     "Like call_later, at time.monotonic() == when."},
    {"stats", (PyCFunction)TimerThread_stats, METH_NOARGS, "The core's counters, as a dict."},
    {"time", (PyCFunction)TimerThread_time, METH_NOARGS, "The core's clock: time.monotonic()."},
    {"_open_port", (PyCFunction)TimerThread_open_port, METH_O, NULL},
    {"_orphans", (PyCFunction)TimerThread_orphans, METH_NOARGS, NULL},
    {"_close_core", (PyCFunction)TimerThread_close_core, METH_NOARGS, NULL},
    {"_scheduler", (PyCFunction)TimerThread_scheduler, METH_VARARGS, NULL},
    {NULL}};

static PyGetSetDef TimerThread_getset[] = {
    {"closed", (getter)TimerThread_get_closed, NULL, "True once close() was called.", NULL},
    {NULL}};

static PyMemberDef TimerThread_members[] = {
    {"__weaklistoffset__", Py_T_PYSSIZET, offsetof(TimerThreadObject, weakreflist), Py_READONLY, NULL},
    {NULL}};

static PyType_Slot TimerThread_slots[] = {
    {Py_tp_doc, "The native part of bucketimer.TimerThread."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, TimerThread_init},
    {Py_tp_dealloc, TimerThread_dealloc},
    {Py_tp_traverse, TimerThread_traverse},
    {Py_tp_clear, TimerThread_clear},
    {Py_tp_methods, TimerThread_methods},
    {Py_tp_getset, TimerThread_getset},
    {Py_tp_members, TimerThread_members},
    {0, NULL}};

PyType_Spec TimerThread_spec = {
    .name = "bucketimer._core.TimerThread",
    .basicsize = sizeof(TimerThreadObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .slots = TimerThread_slots,
};

/* The TimerThread timeouts arm on: the process default, refreshed when it
 * was closed or belongs to a parent process.  Borrowed. */
TimerThreadObject *default_tt(core_state *st) {
    TimerThreadObject *tt = (TimerThreadObject *)st->default_tt;
    if (tt && tt->core && !tt->closed && !bt_is_stopped(tt->core)) return tt;
    if (!st->default_factory) {
        PyErr_SetString(PyExc_RuntimeError, "bucketimer is not initialised");
        return NULL;
    }
    PyObject *n = PyObject_CallNoArgs(st->default_factory);
    if (!n) return NULL;
    if (!PyObject_TypeCheck(n, st->TimerThread_Type)) {
        Py_DECREF(n);
        PyErr_SetString(PyExc_TypeError, "default_timer_thread() must return a TimerThread");
        return NULL;
    }
    Py_XSETREF(st->default_tt, n);
    return (TimerThreadObject *)n;
}
