/*
 * timer_thread_type.c -- bucketimer._core.TimerThread: one bt_timer_thread,
 * its lifetime (init, close, dealloc), call_later/call_at, counters, where
 * its timers go (the port of each loop, and the dispatcher's: this file
 * alone opens, records and forgets them), and the process default
 * TimerThread.  bucketimer.TimerThread (_timers.py) subclasses it to connect
 * a new port to its consumer (_attach: the loop's reader, the dispatcher
 * thread).  Its fields are touched with the GIL held; the one place in the
 * module that lets the GIL go is here, Py_BEGIN_ALLOW_THREADS around
 * bt_create, bt_stop (it joins the timer thread), bt_destroy,
 * bt_deliver_due (it may wait for the thread's pass) and bt_get_stats;
 * bt_drop_all's ext_drop_handle runs after bt_stop, with the
 * GIL back.
 */
#include "module.h"

/* ---- TimerThread -------------------------------------------------------- */

/* An int option in [lo, hi] (an int, not a bool), its errors naming it as
 * the pure backend's do. */
static int int_option(PyObject *o, const char *what, long lo, long hi, unsigned int *out) {
    if (!o) return 0;
    if (PyBool_Check(o) || !PyLong_Check(o)) {
        return ext_type_error(what, "an integer", o);
    }
    int overflow;
    long v = PyLong_AsLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v < lo || v > hi) {
        PyErr_Format(PyExc_ValueError, "%s must be between %ld and %ld", what, lo, hi);
        return -1;
    }
    *out = (unsigned int)v;
    return 0;
}

static int TimerThread_init(TimerThreadObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buckets", "drain_threshold", NULL};
    unsigned int buckets = BT_DEFAULT_BUCKETS, drain = BT_DEFAULT_DRAIN_THRESHOLD;
    PyObject *b = NULL, *d = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O$O:TimerThread", kwlist, &b, &d)) return -1;
    if (self->core) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is already initialised");
        return -1;
    }
    if (int_option(b, "buckets", 1, BT_MAX_BUCKETS, &buckets) < 0 ||
        int_option(d, "drain_threshold", BT_MIN_DRAIN_THRESHOLD, INT_MAX, &drain) < 0)
        return -1;
    self->st = ext_state_of_type(Py_TYPE(self));
    if (!self->st) return -1;
    self->ports = PyDict_New();
    if (!self->ports) return -1;
    bt_options opt;
    bt_options_init(&opt);
    opt.num_buckets = buckets;
    opt.drain_threshold = drain;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bt_create(&opt, &self->core);
    Py_END_ALLOW_THREADS
    if (rc) {
        ext_raise_errno(rc, "bt_create");
        return -1;
    }
    return 0;
}

EXT_GC_TRAVERSE(TimerThread, TimerThreadObject, TIMERTHREAD_REFS)

static int TimerThread_clear(TimerThreadObject *self) {
    self->cached_port = NULL;
    TIMERTHREAD_REFS(EXT_CLEAR_REF)
    return 0;
}

/* Stops the core and drops every pending or posted timer without running
 * it.  Returns how many were dropped, or -1 with RuntimeError set if its
 * thread could not be joined: then nothing is dropped or freed, the core
 * stays stopped (no timer runs, scheduling raises "closed"), and the next
 * call joins and drops.  `closed` is set before the GIL is let go, so a
 * concurrent call returns 0 at once, as it always did. */
static int64_t close_core(TimerThreadObject *self) {
    if (!self->core || self->closed) return 0;
    self->closed = 1;
    self->fast_attach = 0;
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
    return bt_drop_all(self->core, ext_drop_handle, NULL);
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

int ext_check_open(TimerThreadObject *self) {
    if (!self->core) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is not initialised");
        return -1;
    }
    if (self->closed || self->stop_failed || bt_is_stopped(self->core)) {
        /* stopped by neither close() nor a failed one: made before a fork() */
        int forked = !self->closed && !self->stop_failed;
        ext_raise_errno(forked ? -ECHILD : -ESHUTDOWN, "");
        return -1;
    }
    return 0;
}


/* ---- where timers go ------------------------------------------------------
 * A loop's port is opened the first time a timer goes to that loop, recorded
 * in `ports`, then handed to the subclass's _attach, which connects it to
 * the loop (its reader, its close); the dispatcher's port, likewise, once.
 * The record holds neither the loop nor the port: the loop holds its port
 * (its reader), so a loop nobody references is collected with its port, and
 * the port forgets its record then (ext_forget_port).  _forget (a loop
 * closing) and a refused _attach take a record away too.  All of it runs
 * with the GIL held; an allocation or the hook may let it go, so a record is
 * made with setdefault and the first one stays. */

/* (not detached: its fd comes in _attach, bt_port_wake_by) */
static inline int port_is_open(PortObject *p) { return !bt_port_detached(p->port); }

PyObject *ext_weak_target(PyObject *ref) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *o = NULL;
    if (PyWeakref_GetRef(ref, &o) < 0) PyErr_Clear(); /* (always a weakref) */
    return o;
#else
    PyObject *o = PyWeakref_GetObject(ref);
    return o && o != Py_None ? Py_NewRef(o) : NULL;
#endif
}

/* The live port recorded for `loop` (a new reference), NULL if none, or
 * NULL with an exception.  The keys are ints (no Python code compares
 * them); a record whose port is gone, or serves another loop that came to
 * the same address, is none. */
static PortObject *recorded(TimerThreadObject *self, PyObject *loop) {
    if (!self->ports) return NULL;
    PyObject *key = PyLong_FromVoidPtr(loop);
    if (!key) return NULL;
    PyObject *ref = PyDict_GetItemWithError(self->ports, key);
    Py_DECREF(key);
    PortObject *p = ref ? (PortObject *)ext_weak_target(ref) : NULL;
    if (p && p->loop != loop) Py_CLEAR(p);
    return p;
}

/* Takes the record of `loop` away if it names `port` (NULL: whatever it
 * names, or a dead one).  Keeps the caller's exception. */
static void unrecord(TimerThreadObject *self, PyObject *loop, PortObject *port) {
    if (!self->ports || !loop) return;
    PyObject *exc = PyErr_GetRaisedException();
    PyObject *key = PyLong_FromVoidPtr(loop);
    PyObject *ref = key ? PyDict_GetItemWithError(self->ports, key) : NULL;
    if (ref) {
        PyObject *target = ext_weak_target(ref);
        if (!port || !target || target == (PyObject *)port) (void)PyDict_DelItem(self->ports, key);
        Py_XDECREF(target);
    }
    Py_XDECREF(key);
    PyErr_Clear();
    PyErr_SetRaisedException(exc);
}

void ext_forget_port(TimerThreadObject *self, PortObject *port) {
    if (self->cached_port == port) self->cached_port = NULL;
    if (port->loop && port->loop != Py_None) unrecord(self, port->loop, port);
}

static int check_loop(ext_state *st, PyObject *loop) {
    int ok = PyObject_IsInstance(loop, st->AbstractEventLoop);
    if (ok == 0) ext_type_error("loop", "an asyncio event loop or None", loop);
    return ok == 1 ? 0 : -1;
}

/* 1 if `loop` is closed, 0 if not, -1 with an exception. */
static int loop_is_closed(ext_state *st, PyObject *loop) {
    PyObject *r = PyObject_CallMethodNoArgs(loop, st->str_is_closed);
    if (!r) return -1;
    int closed = PyObject_IsTrue(r);
    Py_DECREF(r);
    return closed;
}

/* Takes away the record of loop's port (the dispatcher's, for None) and
 * the cache's: the port (a new reference), NULL if none, or NULL with an
 * exception. */
static PortObject *forget(TimerThreadObject *self, PyObject *loop) {
    if (loop == Py_None) {
        PortObject *d = self->dispatcher;
        self->dispatcher = NULL;
        if (d && self->cached_port == d) self->cached_port = NULL;
        return d;
    }
    PortObject *p = recorded(self, loop);
    if (!p && PyErr_Occurred()) return NULL;
    unrecord(self, loop, NULL);
    if (p && self->cached_port == p) self->cached_port = NULL;
    return p;
}

/* Forgets loop's port and releases it if it is still `port`. */
static void forget_and_release(TimerThreadObject *self, PyObject *loop, PortObject *port) {
    PyObject *exc = PyErr_GetRaisedException();
    PortObject *p = forget(self, loop);
    if (p == port && ext_port_release(p) < 0) PyErr_WriteUnraisable((PyObject *)self);
    if (!p && PyErr_Occurred()) PyErr_WriteUnraisable((PyObject *)self);
    Py_XDECREF(p);
    PyErr_SetRaisedException(exc);
}

/* Records `fresh` as loop's port unless another thread recorded one first:
 * the recorded one, a new reference. */
EXT_COLD static PortObject *record(TimerThreadObject *self, PyObject *loop, PortObject *fresh) {
    if (loop == Py_None) {
        if (!self->dispatcher) self->dispatcher = (PortObject *)Py_NewRef(fresh);
        return (PortObject *)Py_NewRef(self->dispatcher);
    }
    if (!self->ports) {
        PyErr_SetString(PyExc_RuntimeError, "TimerThread is cleared");
        return NULL;
    }
    PyObject *ref = PyWeakref_NewRef((PyObject *)fresh, NULL);
    if (!ref) return NULL;
    /* (the weakref's allocation may run the GC, and so Python code: the
     * record is looked at after it) */
    PortObject *first = recorded(self, loop);
    if (first || PyErr_Occurred()) {
        Py_DECREF(ref);
        return first;
    }
    PyObject *key = PyLong_FromVoidPtr(loop);
    int rc = key ? PyDict_SetItem(self->ports, key, ref) : -1;
    Py_XDECREF(key);
    Py_DECREF(ref);
    return rc < 0 ? NULL : (PortObject *)Py_NewRef(fresh);
}

/* A new port for `loop`, recorded and attached. */
EXT_COLD static PortObject *open_port(TimerThreadObject *self, PyObject *loop) {
    bt_port *bp;
    int rc = bt_port_open(self->core, 0, &bp); /* its fd: _attach's choice */
    if (rc) return (PortObject *)ext_raise_errno(rc, "bt_port_open");
    PortObject *fresh = ext_port_new(self, bp, loop, 0);
    if (!fresh) return NULL; /* bp is the core's, freed with it */
    PortObject *port = record(self, loop, fresh);
    if (port != fresh) { /* lost the race (or failed): fresh was never used */
        PyObject *exc = PyErr_GetRaisedException();
        if (ext_port_release(fresh) < 0) PyErr_WriteUnraisable((PyObject *)self);
        PyErr_SetRaisedException(exc);
        Py_DECREF(fresh);
        return port;
    }
    Py_DECREF(fresh);
    int fast = loop != Py_None ? ext_attach_fast(self, loop, port) : 0;
    PyObject *r = fast ? NULL
                       : PyObject_CallMethodObjArgs((PyObject *)self, self->st->str_attach, loop,
                                                    (PyObject *)port, NULL);
    if (fast < 0 || (!fast && !r)) { /* refused: the exception stands */
        forget_and_release(self, loop, port);
        Py_DECREF(port);
        return NULL;
    }
    Py_XDECREF(r);
    return port;
}

/* The port of `loop` (None: the dispatcher's), a new reference: once the
 * GIL is let go, another thread may forget it and drop every other
 * reference to it. */
PortObject *ext_port_for(TimerThreadObject *self, PyObject *loop) {
#ifndef Py_GIL_DISABLED
    PortObject *cached = self->cached_port;
    if (cached && cached->loop == loop && port_is_open(cached))
        return (PortObject *)Py_NewRef(cached);
#endif
    if (loop == Py_None)
        return self->dispatcher ? (PortObject *)Py_NewRef(self->dispatcher)
                                : open_port(self, loop);
    /* This thread's running loop, of a class vetted for the C attach, is a
     * loop, and open: asyncio's close() refuses to close a running loop.
     * (Asking costs a new loop's first timer two cold calls.) */
    int inside = ext_loop_inside(self->st, loop);
    if (inside < 0 || (!inside && check_loop(self->st, loop) < 0)) return NULL;
    PortObject *port = recorded(self, loop);
    if (!port && PyErr_Occurred()) return NULL;
    int closed = inside ? 0 : loop_is_closed(self->st, loop);
    if (closed) { /* (or is_closed() raised: its exception stands) */
        if (closed > 0) { /* a loop that closed without its close hook running */
            if (port) forget_and_release(self, loop, port);
            PyErr_SetString(PyExc_RuntimeError, "cannot schedule on a closed event loop");
        }
        Py_XDECREF(port);
        return NULL;
    }
    if (port && !port_is_open(port)) { /* detached behind our back: a new one */
        forget_and_release(self, loop, port);
        Py_CLEAR(port);
    }
    if (!port && !(port = open_port(self, loop))) return NULL;
#ifndef Py_GIL_DISABLED
    self->cached_port = port; /* borrowed: the port clears it when it goes */
#endif
    return port;
}

/* ---- order on the loop (docs/design.rst, "Order on the loop") -------------
 * Something queued with loop.call_soon after a deadline passed must come
 * after the timers due by then, as in asyncio's heap; a timer due in the
 * core may still wait for the timer thread or sit in the port, unseen until
 * the loop's next poll.  So the loop's thread runs the pass for its port
 * (ext_port_deliver_due), and if the port then holds anything its drain is
 * queued first, bounded by the loop's last poll: what asyncio's heap would
 * have moved to this iteration's ready queue ahead of the expiry (what fell
 * due or was scheduled since runs after it, in the next iteration).  A loop
 * with no port has no timers to wait for. */

static int deliver_to(TimerThreadObject *self, PyObject *loop) {
    PortObject *port = recorded(self, loop);
    if (!port) return PyErr_Occurred() ? -1 : 0;
    int ok = 1;
    if (port_is_open(port)) {
        ext_port_deliver_due(port, bt_now_ns());
        if (bt_port_has_posted(port->port)) {
            uint64_t seq;
            int64_t bound = ext_port_drain_bound(port, &seq);
            PyObject *until = bound >= 0 ? PyLong_FromLongLong(bound) : Py_NewRef(Py_None);
            PyObject *before = !until            ? NULL
                               : seq == UINT64_MAX ? Py_NewRef(Py_None)
                                                   : PyLong_FromUnsignedLongLong(seq);
            PyObject *drain = before ? PyObject_GetAttr((PyObject *)port, self->st->str_drain) : NULL;
            PyObject *h = drain ? PyObject_CallMethodObjArgs(loop, self->st->str_call_soon, drain,
                                                             until, before, NULL)
                                : NULL;
            Py_XDECREF(until);
            Py_XDECREF(before);
            Py_XDECREF(drain);
            Py_XDECREF(h);
            ok = h != NULL;
        }
    }
    Py_DECREF(port);
    return ok ? 0 : -1;
}

/* TimerThread._test_hold(hold): test only (bt_test_hold). */
static PyObject *TimerThread_test_hold(TimerThreadObject *self, PyObject *arg) {
    int hold = PyObject_IsTrue(arg);
    if (hold < 0) return NULL;
    if (ext_check_open(self) < 0) return NULL;
    int rc = bt_test_hold(self->core, hold);
    if (rc) return ext_raise_errno(rc, "_test_hold");
    Py_RETURN_NONE;
}

static PyObject *TimerThread_port(TimerThreadObject *self, PyObject *loop) {
    if (ext_check_open(self) < 0) return NULL;
    return (PyObject *)ext_port_for(self, loop);
}

static PyObject *TimerThread_port_of_made(TimerThreadObject *self, PyObject *loop) {
    if (ext_check_open(self) < 0) return NULL;
    return (PyObject *)ext_port_of_made(self, loop);
}

static PyObject *TimerThread_forget(TimerThreadObject *self, PyObject *loop) {
    if (!self->ports) Py_RETURN_NONE;
    PortObject *p = forget(self, loop);
    if (!p && PyErr_Occurred()) return NULL;
    return p ? (PyObject *)p : Py_NewRef(Py_None);
}

static PyObject *TimerThread_attach(TimerThreadObject *self, PyObject *const *args,
                                    Py_ssize_t nargs) {
    (void)args;
    (void)nargs;
    PyErr_Format(PyExc_NotImplementedError,
                 "%.100s cannot connect a port to its loop: use bucketimer.TimerThread",
                 Py_TYPE(self)->tp_name);
    return NULL;
}

/* {loop: Port} of the ports alive. */
static PyObject *TimerThread_get_ports(TimerThreadObject *self, void *Py_UNUSED(c)) {
    PyObject *out = PyDict_New();
    PyObject *refs = self->ports ? PyDict_Values(self->ports) : NULL;
    if (!out || (self->ports && !refs)) goto fail;
    for (Py_ssize_t i = 0; refs && i < PyList_GET_SIZE(refs); i++) {
        PortObject *p = (PortObject *)ext_weak_target(PyList_GET_ITEM(refs, i));
        int rc = p && p->loop ? PyDict_SetItem(out, p->loop, (PyObject *)p) : 0;
        Py_XDECREF(p);
        if (rc < 0) goto fail;
    }
    Py_XDECREF(refs);
    return out;
fail:
    Py_XDECREF(refs);
    Py_XDECREF(out);
    return NULL;
}

static PyObject *TimerThread_get_dispatcher(TimerThreadObject *self, void *Py_UNUSED(c)) {
    return Py_NewRef(self->dispatcher ? (PyObject *)self->dispatcher : Py_None);
}

/* call_later(delay, callback, *args, loop=None, context=None) and call_at. */
static PyObject *call_later_or_at(TimerThreadObject *self, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames, int absolute) {
    PyObject *loop = NULL, *context = NULL;
    if (ext_parse_schedule_args(args, nargs, kwnames, absolute, &loop, &context) < 0) return NULL;
    if (ext_check_open(self) < 0) return NULL;
    double t;
    if (ext_to_seconds(args[0], absolute ? "when" : "delay", &t) < 0) return NULL;
    /* Where it will be delivered. */
    PyObject *resolved = NULL;
    if (loop == NULL || loop == Py_None) {
        resolved = ext_running_loop(&self->st->compat);
        if (!resolved) return NULL;
    } else {
        resolved = Py_NewRef(loop);
    }
    PyObject *h = ext_schedule(self, absolute, t, args[1], args + 2, nargs - 2, resolved,
                                    context, 0);
    Py_DECREF(resolved);
    if (h && absolute) ext_handle_keep_when(h, args[0]);
    return h;
}

static PyObject *TimerThread_call_later(TimerThreadObject *self, PyObject *const *args,
                                        Py_ssize_t nargs, PyObject *kwnames) {
    return call_later_or_at(self, args, PyVectorcall_NARGS(nargs), kwnames, 0);
}

static PyObject *TimerThread_call_at(TimerThreadObject *self, PyObject *const *args,
                                     Py_ssize_t nargs, PyObject *kwnames) {
    return call_later_or_at(self, args, PyVectorcall_NARGS(nargs), kwnames, 1);
}

/* 0 if the arguments fit `name(first, callback, /, *args, loop=None,
 * context=None)`; else the error Python's own argument parsing gives: the
 * function of that signature registered by _timers (_set_signatures) is
 * called with them and raises it (its words change between versions: 3.13
 * added "Did you mean ...?"). */
static int check_module_args(ext_state *st, int absolute, PyObject *const *args,
                             Py_ssize_t nargs, PyObject *kwnames) {
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    int fits = nargs >= 2;
    for (Py_ssize_t i = 0; fits && i < nk; i++) {
        PyObject *k = PyTuple_GET_ITEM(kwnames, i);
        fits = PyUnicode_CompareWithASCIIString(k, "loop") == 0 ||
               PyUnicode_CompareWithASCIIString(k, "context") == 0;
    }
    if (fits) return 0;
    PyObject *sig = Py_XNewRef(absolute ? st->sig_call_at : st->sig_call_later);
    PyObject *r = sig ? PyObject_Vectorcall(sig, args, (size_t)nargs, kwnames) : NULL;
    Py_XDECREF(sig);
    if (r) { /* (it took them: it cannot, but a TypeError says so) */
        Py_DECREF(r);
        PyErr_Format(PyExc_TypeError, "%s() takes a %s and a callback",
                     absolute ? "call_at" : "call_later", absolute ? "when" : "delay");
    } else if (!sig) {
        PyErr_SetString(PyExc_RuntimeError, "bucketimer is not initialised");
    }
    return -1;
}

/* _core._set_signatures(call_later, call_at): the Python functions whose
 * argument errors the module functions raise. */
PyObject *ext_set_signatures(PyObject *m, PyObject *args) {
    ext_state *st = ext_state_of_module(m);
    PyObject *later, *at;
    if (!PyArg_ParseTuple(args, "OO:_set_signatures", &later, &at)) return NULL;
    Py_XSETREF(st->sig_call_later, Py_NewRef(later));
    Py_XSETREF(st->sig_call_at, Py_NewRef(at));
    Py_RETURN_NONE;
}

/* bucketimer.call_later / call_at: the default TimerThread's, whichever it
 * is when called. */
static PyObject *module_call(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames, int absolute) {
    ext_state *st = ext_state_of_module(m);
    if (check_module_args(st, absolute, args, nargs, kwnames) < 0) return NULL;
    TimerThreadObject *tt = ext_default_tt(st);
    if (!tt) return NULL;
    Py_INCREF(tt); /* scheduling runs Python code, which may replace the default */
    PyObject *h = call_later_or_at(tt, args, nargs, kwnames, absolute);
    Py_DECREF(tt);
    return h;
}

PyObject *ext_module_call_later(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames) {
    return module_call(m, args, nargs, kwnames, 0);
}

PyObject *ext_module_call_at(PyObject *m, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames) {
    return module_call(m, args, nargs, kwnames, 1);
}

static PyObject *TimerThread_orphans(TimerThreadObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->core) return ext_raise_errno(-EINVAL, "orphans");
    return (PyObject *)ext_port_new(self, bt_orphans(self->core), Py_None, 1);
}

static PyObject *TimerThread_close_core(TimerThreadObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->core) Py_RETURN_NONE;
    int64_t n = close_core(self);
    if (n < 0) return NULL;  /* left as close_core says */
    return PyLong_FromLongLong(n);
}

static PyObject *TimerThread_get_closed(TimerThreadObject *self, void *Py_UNUSED(c)) {
    return PyBool_FromLong(!self->core || self->closed || bt_is_stopped(self->core));
}

static PyObject *TimerThread_time(TimerThreadObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored)) {
    return PyFloat_FromDouble((double)bt_now_ns() / 1e9);
}

/* ---- introspection ----------------------------------------------------------- */

void ext_note_armed(ext_state *st, PyObject *h) {
    PyObject *hook = Py_NewRef(st->armed_hook); /* the hook may replace itself */
    PyObject *r = PyObject_CallOneArg(hook, h);
    if (r) Py_DECREF(r);
    else PyErr_WriteUnraisable(hook);
    Py_DECREF(hook);
}

/* bt_foreach_pending's callback: each port timer's Handle, a new reference
 * in the list (ctx).  Nothing here runs Python code (PyList_Append
 * allocates no object the cycle collector tracks), so no payload can be
 * released during the walk: that takes the GIL, which the walk holds. */
static int32_t keep_pending(void *ctx, bt_port *port, void *payload, uint64_t id,
                            int64_t deadline_ns) {
    (void)id;
    (void)deadline_ns;
    if (!port || !payload) return 0; /* a native timer: the module schedules none */
    return PyList_Append((PyObject *)ctx, (PyObject *)payload) < 0;
}

static PyObject *TimerThread_pending_handles(TimerThreadObject *self,
                                             PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(0);
    if (!out || !self->core || self->closed) return out;
    int64_t n = bt_foreach_pending(self->core, keep_pending, out);
    if (PyErr_Occurred()) {
        Py_DECREF(out);
        return NULL;
    }
    if (n == -ECHILD) return out; /* made before a fork(): nothing pending here */
    if (n < 0) {
        Py_DECREF(out);
        return ext_raise_errno((int)n, "bt_foreach_pending");
    }
    return out;
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
     "call_later($self, delay, callback, /, *args, loop=None, context=None)\n--\n\n"
     "Run callback(*args) after delay seconds.  Inside a running event loop (or with loop=) it "
     "runs in that loop's thread; otherwise on this TimerThread's dispatcher thread."},
    {"call_at", (PyCFunction)(void (*)(void))TimerThread_call_at, METH_FASTCALL | METH_KEYWORDS,
     "call_at($self, when, callback, /, *args, loop=None, context=None)\n--\n\n"
     "Like call_later, at time.monotonic() == when."},
    {"stats", (PyCFunction)TimerThread_stats, METH_NOARGS,
     "stats($self, /)\n--\n\nThe core's counters, as a dict."},
    {"time", (PyCFunction)TimerThread_time, METH_NOARGS,
     "time($self, /)\n--\n\nThe core's clock: time.monotonic()."},
    {"_port", (PyCFunction)TimerThread_port, METH_O,
     "_port(loop) -> Port\n\nThe port of loop (None: the dispatcher's), opened and attached "
     "on first use."},
    {"_port_of_made", (PyCFunction)TimerThread_port_of_made, METH_O,
     "_port_of_made(loop) -> Port\n\nThe port of a loop that its constructor is making in this "
     "thread, opened and attached as the running loop's."},
    {"_forget", (PyCFunction)TimerThread_forget, METH_O,
     "_forget(loop) -> Port | None\n\nForget loop's port and return it (to be detached)."},
    {"_attach", (PyCFunction)(void (*)(void))TimerThread_attach, METH_FASTCALL,
     "_attach(loop, port)\n\nConnect a newly opened port to its consumer; a subclass's job."},
    {"_orphans", (PyCFunction)TimerThread_orphans, METH_NOARGS, NULL},
    {"_pending_handles", (PyCFunction)TimerThread_pending_handles, METH_NOARGS,
     "_pending_handles($self, /)\n--\n\nThe Handles of the timers scheduled and not yet run, "
     "cancelled or dropped (bucketimer.TimerThread.pending)."},
    {"_close_core", (PyCFunction)TimerThread_close_core, METH_NOARGS, NULL},
    {"_scheduler", (PyCFunction)ext_TimerThread_scheduler, METH_VARARGS, NULL},
    {"_test_hold", (PyCFunction)TimerThread_test_hold, METH_O,
     "_test_hold(hold)\n\nTest only: while held, the timer thread runs no pass, as one "
     "waiting for a CPU; close() lets it go."},
    {NULL}};

static PyObject *TimerThread_get_fast_attach(TimerThreadObject *self, void *Py_UNUSED(c)) {
    return PyBool_FromLong(self->fast_attach);
}

static int TimerThread_set_fast_attach(TimerThreadObject *self, PyObject *v, void *Py_UNUSED(c)) {
    int on = v ? PyObject_IsTrue(v) : 0;
    if (on < 0) return -1;
    self->fast_attach = on;
    return 0;
}

static PyGetSetDef TimerThread_getset[] = {
    {"_fast_attach", (getter)TimerThread_get_fast_attach, (setter)TimerThread_set_fast_attach,
     "True while a loop's new port may be connected in C (ext/attach.c): set by the "
     "subclass once its dispatcher audits the loops.", NULL},
    {"closed", (getter)TimerThread_get_closed, NULL, "True once close() was called.", NULL},
    {"_ports", (getter)TimerThread_get_ports, NULL, "{loop: Port} of the loops served.", NULL},
    {"_dispatcher", (getter)TimerThread_get_dispatcher, NULL,
     "The dispatcher's Port, or None before it is needed.", NULL},
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

/* ---- the process default -------------------------------------------------- */

static int is_live(TimerThreadObject *tt) {
    return tt && tt->core && !tt->closed && !bt_is_stopped(tt->core);
}

/* The process default TimerThread (borrowed): made on first use from the
 * class bucketimer registered, and made anew once closed or inherited
 * through fork() (its core is stopped in the child). */
TimerThreadObject *ext_default_tt(ext_state *st) {
    TimerThreadObject *tt = (TimerThreadObject *)st->default_tt;
    if (is_live(tt)) return tt;
    if (!st->default_class) {
        PyErr_SetString(PyExc_RuntimeError, "bucketimer is not initialised");
        return NULL;
    }
    PyObject *n = PyObject_CallNoArgs(st->default_class);
    if (!n) return NULL;
    if (!PyObject_TypeCheck(n, st->TimerThread_Type)) {
        Py_DECREF(n);
        PyErr_SetString(PyExc_TypeError, "the default TimerThread class made no TimerThread");
        return NULL;
    }
    /* Making one runs Python code: another thread may have made the
     * default meanwhile.  The first one stays; this one is closed. */
    tt = (TimerThreadObject *)st->default_tt;
    if (is_live(tt)) {
        PyObject *r = PyObject_CallMethodNoArgs(n, st->str_close);
        if (r) Py_DECREF(r);
        else PyErr_WriteUnraisable(n);
        Py_DECREF(n);
        return tt;
    }
    Py_XSETREF(st->default_tt, n);
    return (TimerThreadObject *)n;
}

/* The default TimerThread's due timers for `loop`, ahead of a call_soon
 * (above, "order on the loop"); none to wait for if there is none yet. */
int ext_deliver_due(ext_state *st, PyObject *loop) {
    TimerThreadObject *tt = (TimerThreadObject *)st->default_tt;
    if (!is_live(tt)) return 0;
    /* held: a pass may let the GIL go, and another thread replace the
     * default meanwhile */
    Py_INCREF(tt);
    int rc = deliver_to(tt, loop);
    Py_DECREF(tt);
    return rc;
}
