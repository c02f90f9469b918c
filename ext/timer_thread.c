/*
 * timer_thread.c -- bucketimer._core.TimerThread: one bt_timer_thread, its
 * lifetime (init, close, dealloc), call_later/call_at, ports and counters.
 * bucketimer.TimerThread (_timers.py) subclasses it for what happens once
 * per loop; the process default lives in the module state.  Its fields are
 * touched with the GIL held; the one place in the module that lets the GIL
 * go is here, Py_BEGIN_ALLOW_THREADS around bt_create, bt_stop (it joins
 * the timer thread), bt_destroy and bt_get_stats; bt_drop_all's drop_handle
 * runs after bt_stop, with the GIL back.
 */
#include "module.h"

/* ---- TimerThread -------------------------------------------------------- */

static int TimerThread_init(TimerThreadObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buckets", "drain_threshold", NULL};
    unsigned int buckets = BT_DEFAULT_BUCKETS, drain = BT_DEFAULT_DRAIN_THRESHOLD;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|I$I:TimerThread", kwlist, &buckets, &drain))
        return -1;
    if (self->core) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is already initialised");
        return -1;
    }
    if (buckets < 1 || buckets > BT_MAX_BUCKETS) {
        PyErr_Format(PyExc_ValueError, "buckets must be between 1 and %d", BT_MAX_BUCKETS);
        return -1;
    }
    if (drain < BT_MIN_DRAIN_THRESHOLD) {
        PyErr_Format(PyExc_ValueError, "drain_threshold must be at least %d",
                     BT_MIN_DRAIN_THRESHOLD);
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
    Py_BEGIN_ALLOW_THREADS
    rc = bt_create(&opt, &self->core);
    Py_END_ALLOW_THREADS
    if (rc) {
        raise_errno(rc, "bt_create");
        return -1;
    }
    return 0;
}

BT_GC_TRAVERSE(TimerThread, TimerThreadObject, TIMERTHREAD_REFS)
BT_GC_CLEAR(TimerThread, TimerThreadObject, TIMERTHREAD_REFS)

/* Stops the core and drops every pending or posted timer without running
 * it.  Returns how many were dropped, or -1 with RuntimeError set if its
 * thread could not be joined: then nothing is dropped or freed, the core
 * stays stopped (no timer runs, scheduling raises "closed"), and the next
 * call joins and drops.  `closed` is set before the GIL is let go, so a
 * concurrent call returns 0 at once, as it always did. */
static int64_t close_core(TimerThreadObject *self) {
    if (!self->core || self->closed) return 0;
    self->closed = 1;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bt_stop(self->core);
    Py_END_ALLOW_THREADS
    if (rc) {
        self->closed = 0;
        self->stop_failed = 1;
        PyErr_Format(PyExc_RuntimeError,
                     "TimerThread.close(): its timer thread could not be joined (%s); it is "
                     "stopped -- no timer runs, none can be scheduled -- and keeps its "
                     "pending timers until close() succeeds", strerror(-rc));
        return -1;
    }
    self->stop_failed = 0;
    return bt_drop_all(self->core, drop_handle, NULL);
}

static void TimerThread_dealloc(TimerThreadObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    TimerThread_clear(self);
    if (self->core) {
        /* No handle or port refers to us any more (they hold references),
         * so nothing is pending: stopping and freeing is safe.  A core whose
         * thread cannot be joined is not freed (bt_destroy refuses): it
         * leaks, reported, rather than be freed under a live thread. */
        PyObject *exc = PyErr_GetRaisedException();  /* a dealloc keeps the caller's */
        int rc = close_core(self) < 0 ? -1 : 0;
        if (rc == 0) {
            Py_BEGIN_ALLOW_THREADS
            rc = bt_destroy(self->core);
            Py_END_ALLOW_THREADS
            if (rc)
                PyErr_Format(PyExc_RuntimeError, "TimerThread: bt_destroy failed (%s)",
                             strerror(-rc));
        }
        if (rc) PyErr_WriteUnraisable(NULL);
        if (exc) PyErr_SetRaisedException(exc);  /* (3.11's compat.h wants one) */
        self->core = NULL;
    }
    tp->tp_free(self);
    Py_DECREF(tp);
}

int check_open(TimerThreadObject *self) {
    if (!self->core) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is not initialised");
        return -1;
    }
    if (self->closed || self->stop_failed || bt_is_stopped(self->core)) {
        /* stopped by neither close() nor a failed one: made before a fork() */
        int forked = !self->closed && !self->stop_failed;
        raise_errno(forked ? -ECHILD : -ESHUTDOWN, "");
        return -1;
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
    if (n < 0) return NULL;  /* left as close_core says; the caches stay valid */
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

static int put_counter(PyObject *d, const char *name, uint64_t value) {
    PyObject *v = PyLong_FromUnsignedLongLong(value);
    if (!v) return -1;
    int rc = PyDict_SetItemString(d, name, v);
    Py_DECREF(v);
    return rc;
}

/* stats(): every counter of bt_stats (BT_STATS_COUNTERS), then the
 * lateness histogram, as a dict (bucketimer.Stats). */
static PyObject *TimerThread_stats(TimerThreadObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->core) return PyDict_New();
    bt_stats s;
    Py_BEGIN_ALLOW_THREADS
    bt_get_stats(self->core, &s);
    Py_END_ALLOW_THREADS
    PyObject *d = PyDict_New();
    if (!d) return NULL;
#define PUT(name) if (put_counter(d, #name, s.name) < 0) goto fail;
    BT_STATS_COUNTERS(PUT)
#undef PUT
    PyObject *hist = PyList_New(BT_HIST_BUCKETS);
    if (!hist) goto fail;
    for (int i = 0; i < BT_HIST_BUCKETS; i++) {
        PyObject *n = PyLong_FromUnsignedLongLong(s.lateness_hist[i]);
        if (!n) {
            Py_DECREF(hist);
            goto fail;
        }
        PyList_SET_ITEM(hist, i, n);
    }
    int rc = PyDict_SetItemString(d, "lateness_hist", hist);
    Py_DECREF(hist);
    if (rc == 0) return d;
fail:
    Py_DECREF(d);
    return NULL;
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
