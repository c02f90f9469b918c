/*
 * handle_type.c -- bucketimer.Handle: one scheduled callback.
 *
 * While its timer is PENDING or POSTED, the core's slot owns one reference
 * to the Handle, taken at schedule.  Exactly one party drops it, always
 * with the GIL: cancel() when its CAS wins, the port's consumer after
 * running the callback, or TimerThread.close() for the timers it drops
 * (docs/design.rst, "Ownership of a Handle").  A Handle's fields are touched
 * only with the GIL held; against the timer thread, the core's CAS on the
 * slot's state word (not a lock) decides between a cancel and a fire.
 * Only this file changes a Handle once made: the port's drain runs it
 * (ext_handle_run), a Timeout moves it (ext_handle_postpone), close drops it.
 *
 * Two types share the layout and all of this: Handle, what a TimerThread's
 * call_later/call_at return, whose cancel() says whether it won; and
 * LoopHandle, what the drop-in loop's return, with asyncio.TimerHandle's
 * methods (cancel() returns None; cancelled() is True once cancel() was
 * called).  One method, one meaning, on each (docs/asyncio.rst).
 */
#include "module.h"

#include <string.h>

EXT_GC_TRAVERSE(Handle, HandleObject, HANDLE_REFS)

/* What a Handle holds of the caller's (its callback and what goes with it)
 * breaks any cycle through it; its TimerThread and port stay while the core
 * holds it, for the port's clear, which releases it, to find it whole. */
static int Handle_clear(HandleObject *self) {
    HANDLE_CALLBACK_REFS(EXT_CLEAR_REF)
    if (!self->held) {
        Py_CLEAR(self->port);
        Py_CLEAR(self->tt);
    }
    return 0;
}

/* ---- the core's reference (docs/design.rst, "Lifetimes") -------------------
 * The slot's reference to a Handle is invisible to the cyclic GC, which would
 * then take every pending Handle -- and what its callback reaches, the loop
 * often -- for reachable from outside.  So the Handle's port claims it: each
 * held Handle is on its port's list, which the port's traverse visits.  The
 * list changes with the GIL held, in the same step as the reference, so the
 * GC never sees one without the other. */

void ext_handle_hold(HandleObject *h) {
    PortObject *p = h->port;
    h->held = 1;
    h->held_prev = NULL;
    h->held_next = p->held;
    if (p->held) p->held->held_prev = h;
    p->held = h;
}

void ext_handle_unhold(HandleObject *h) {
    if (!h->held) return;
    h->held = 0;
    if (h->held_prev) h->held_prev->held_next = h->held_next;
    else h->port->held = h->held_next;
    if (h->held_next) h->held_next->held_prev = h->held_prev;
    h->held_prev = h->held_next = NULL;
}

static void Handle_dealloc(HandleObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    Handle_clear(self);
    ext_state *st = ext_state_alive(tp);
    /* one free list for both types: a taken object is made anew as either */
    if (st && (tp == st->Handle_Type || tp == st->LoopHandle_Type) &&
        ext_freelist_put(&st->handles, (PyObject *)self))
        return;
    tp->tp_free(self);
    Py_DECREF(tp);
}

static HandleObject *handle_alloc(ext_state *st, PyTypeObject *tp) {
    HandleObject *h = (HandleObject *)ext_freelist_take(&st->handles, tp);
    return h ? h : PyObject_GC_New(HandleObject, tp);
}

HandleObject *ext_handle_new(TimerThreadObject *tt, PortObject *port, double when, PyObject *cb,
                         PyObject *const *args, Py_ssize_t nargs, PyObject *context, int flags) {
    ext_state *st = tt->st;
    HandleObject *h =
        handle_alloc(st, (flags & EXT_SCHED_COMPAT) ? st->LoopHandle_Type : st->Handle_Type);
    if (!h) {
        Py_DECREF(port);
        return NULL;
    }
    h->tt = (TimerThreadObject *)Py_NewRef(tt);
    h->port = port;
    h->id = 0;
    h->when = when;
    h->when_obj = NULL;
    h->callback = Py_NewRef(cb);
    h->args = ext_tuple_from_array(args, nargs);
    /* A Timeout's expiry only calls task.cancel(): it needs no copy of the
     * context (asyncio's handle would run it in one; nothing reads it). */
    h->context = context                    ? Py_NewRef(context)
                 : (flags & EXT_SCHED_TIMEOUT) ? NULL
                                            : PyContext_CopyCurrent();
    atomic_init(&h->state, H_PENDING);
    h->cancel_called = 0;
    h->is_timeout = (flags & EXT_SCHED_TIMEOUT) != 0;
    h->held = 0;
    h->held_prev = h->held_next = NULL;
    h->weakreflist = NULL;
    PyObject_GC_Track(h);
    if (!h->args || (!h->context && !(flags & EXT_SCHED_TIMEOUT))) {
        Py_DECREF(h);
        return NULL;
    }
    return h;
}

static inline int is_loop_handle(HandleObject *h) {
    return h->tt && Py_TYPE(h) == h->tt->st->LoopHandle_Type;
}

void ext_handle_keep_when(PyObject *h, PyObject *when) {
    if (PyLong_CheckExact(when) || (is_loop_handle((HandleObject *)h) && !PyFloat_CheckExact(when)))
        Py_XSETREF(((HandleObject *)h)->when_obj, Py_NewRef(when));
}

void ext_handle_when_nan(PyObject *h) { ((HandleObject *)h)->when = NAN; }

void ext_handle_abandon(HandleObject *h) {
    atomic_store(&h->state, H_DROPPED);
    Py_DECREF(h); /* the slot's */
    Py_DECREF(h);
}

/* Drops what a finished handle no longer needs (the tt and port stay, so
 * cancel() after the fact still has something to ask). */
void ext_handle_release_callback(HandleObject *self) {
    PyObject *cb = self->callback, *args = self->args, *ctx = self->context;
    self->callback = self->args = self->context = NULL;
    Py_XDECREF(cb);
    Py_XDECREF(args);
    Py_XDECREF(ctx);
}

/* 1 if this call won the cancel, 0 if not. */
int ext_handle_cancel(HandleObject *self) {
    if (atomic_load_explicit(&self->state, memory_order_acquire) != H_PENDING || !self->tt)
        return 0;
    int rc = bt_cancel(self->tt->core, self->id);
    if (rc != BT_CANCELLED) return 0;
    /* We won the core's CAS: nobody else will touch the callback, and the
     * slot's reference to us is ours to drop. */
    atomic_store_explicit(&self->state, H_CANCELLED, memory_order_release);
    ext_handle_unhold(self);
    ext_handle_release_callback(self);
    Py_DECREF(self); /* the slot's reference; the caller still holds one */
    return 1;
}

static PyObject *Handle_cancel(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyBool_FromLong(ext_handle_cancel(self));
}

static PyObject *Handle_cancelled(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyBool_FromLong(atomic_load(&self->state) == H_CANCELLED);
}

static PyObject *LoopHandle_cancel(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    self->cancel_called = 1;
    ext_handle_cancel(self);
    Py_RETURN_NONE;
}

static PyObject *LoopHandle_cancelled(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyBool_FromLong(self->cancel_called);
}

/* when(), and asyncio.TimerHandle's private `_when`, which tests read from
 * what loop.call_at returned (docs/asyncio.rst, "The drop-in loop"). */
static PyObject *Handle_when(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->when_obj) return Py_NewRef(self->when_obj);
    return PyFloat_FromDouble(self->when);
}

static PyObject *Handle_get_when(HandleObject *self, void *Py_UNUSED(c)) {
    return Handle_when(self, NULL);
}

static PyObject *Handle_get_context(HandleObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->context) Py_RETURN_NONE;
    return Py_NewRef(self->context);
}

static PyObject *Handle_get_id(HandleObject *self, void *Py_UNUSED(c)) {
    return PyLong_FromUnsignedLongLong(self->id);
}

static PyObject *Handle_get_loop(HandleObject *self, void *Py_UNUSED(c)) {
    if (!self->port || !self->port->loop) Py_RETURN_NONE; /* (a GC clear) */
    return Py_NewRef(self->port->loop);
}

static PyObject *Handle_get_callback(HandleObject *self, void *Py_UNUSED(c)) {
    if (!self->callback) Py_RETURN_NONE;
    return Py_NewRef(self->callback);
}

static PyObject *Handle_get_args(HandleObject *self, void *Py_UNUSED(c)) {
    if (!self->args) Py_RETURN_NONE;
    return Py_NewRef(self->args);
}

/* The callback and `when` are formatted with %R, which runs Python code (a
 * float subclass's __repr__, the callback's) that may cancel this handle and
 * so drop its callback: both are held here. */
static PyObject *Handle_repr(HandleObject *self) {
    static const char *names[] = {"pending", "cancelled", "ran", "dropped"};
    const char *kind = strcmp(Py_TYPE(self)->tp_name, "bucketimer._core.LoopHandle") == 0
                           ? "LoopHandle"
                           : "Handle";
    int st = atomic_load(&self->state);
    PyObject *cb = Py_XNewRef(self->callback);
    if (!cb)
        return PyUnicode_FromFormat("<bucketimer.%s %s id=%llu>", kind, names[st],
                                    (unsigned long long)self->id);
    PyObject *when = Handle_when(self, NULL);
    PyObject *r = when ? PyUnicode_FromFormat("<bucketimer.%s %s when=%R %R>", kind, names[st],
                                              when, cb)
                       : NULL;
    Py_XDECREF(when);
    Py_DECREF(cb);
    return r;
}

#define HANDLE_WHEN_DOC                                                                      \
    "when($self, /)\n--\n\nThe deadline, in time.monotonic() seconds (the int given to "     \
    "call_at, if it was one)."
#define HANDLE_GET_CONTEXT_DOC                                                               \
    "get_context($self, /)\n--\n\nThe contextvars.Context the callback runs in (None once " \
    "finished)."

static PyMethodDef Handle_methods[] = {
    {"cancel", (PyCFunction)Handle_cancel, METH_NOARGS,
     "cancel($self, /)\n--\n\nTrue iff this call guaranteed the callback never runs. False if "
     "it is running, has run, was cancelled or dropped before, or its TimerThread is closed."},
    {"cancelled", (PyCFunction)Handle_cancelled, METH_NOARGS,
     "cancelled($self, /)\n--\n\nTrue iff a cancel() of this handle won."},
    {"when", (PyCFunction)Handle_when, METH_NOARGS, HANDLE_WHEN_DOC},
    {"get_context", (PyCFunction)Handle_get_context, METH_NOARGS, HANDLE_GET_CONTEXT_DOC},
    {NULL}};

static PyMethodDef LoopHandle_methods[] = {
    {"cancel", (PyCFunction)LoopHandle_cancel, METH_NOARGS,
     "cancel($self, /)\n--\n\nCancel the callback if it has not run (asyncio.TimerHandle."
     "cancel()): returns None."},
    {"cancelled", (PyCFunction)LoopHandle_cancelled, METH_NOARGS,
     "cancelled($self, /)\n--\n\nTrue once cancel() was called, even if the callback had "
     "run (asyncio.TimerHandle.cancelled())."},
    {"when", (PyCFunction)Handle_when, METH_NOARGS, HANDLE_WHEN_DOC},
    {"get_context", (PyCFunction)Handle_get_context, METH_NOARGS, HANDLE_GET_CONTEXT_DOC},
    {NULL}};

static PyGetSetDef Handle_getset[] = {
    {"id", (getter)Handle_get_id, NULL, "The core's versioned timer id.", NULL},
    {"_when", (getter)Handle_get_when, NULL, "when(), as asyncio.TimerHandle's _when.", NULL},
    {"loop", (getter)Handle_get_loop, NULL, "The loop it is delivered to (None: dispatcher).",
     NULL},
    {"callback", (getter)Handle_get_callback, NULL, "The callback (None once finished).", NULL},
    {"args", (getter)Handle_get_args, NULL, "The callback's arguments (None once finished).",
     NULL},
    {NULL}};

static PyMemberDef Handle_members[] = {
    {"__weaklistoffset__", Py_T_PYSSIZET, offsetof(HandleObject, weakreflist), Py_READONLY, NULL},
    {NULL}};

static PyType_Slot Handle_slots[] = {
    {Py_tp_doc, "A scheduled callback.  Made by TimerThread.call_later / call_at."},
    {Py_tp_dealloc, Handle_dealloc},
    {Py_tp_traverse, Handle_traverse},
    {Py_tp_clear, Handle_clear},
    {Py_tp_methods, Handle_methods},
    {Py_tp_getset, Handle_getset},
    {Py_tp_members, Handle_members},
    {Py_tp_repr, Handle_repr},
    {0, NULL}};

static PyType_Slot LoopHandle_slots[] = {
    {Py_tp_doc, "A callback the drop-in loop's call_later / call_at scheduled, with "
                "asyncio.TimerHandle's methods."},
    {Py_tp_dealloc, Handle_dealloc},
    {Py_tp_traverse, Handle_traverse},
    {Py_tp_clear, Handle_clear},
    {Py_tp_methods, LoopHandle_methods},
    {Py_tp_getset, Handle_getset},
    {Py_tp_members, Handle_members},
    {Py_tp_repr, Handle_repr},
    {0, NULL}};

#define HANDLE_FLAGS                                                      \
    (Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE | \
     Py_TPFLAGS_DISALLOW_INSTANTIATION)

PyType_Spec Handle_spec = {
    .name = "bucketimer._core.Handle",
    .basicsize = sizeof(HandleObject),
    .flags = HANDLE_FLAGS,
    .slots = Handle_slots,
};

PyType_Spec LoopHandle_spec = {
    .name = "bucketimer._core.LoopHandle",
    .basicsize = sizeof(HandleObject),
    .flags = HANDLE_FLAGS,
    .slots = LoopHandle_slots,
};

/* ---- what the rest of the module does to a Handle ------------------------- */

static inline int is_exit(void) {
    return PyErr_ExceptionMatches(PyExc_KeyboardInterrupt) ||
           PyErr_ExceptionMatches(PyExc_SystemExit);
}

/* The callback, in its context (a Timeout's expiry has none: see
 * ext_handle_new).  Its result, or NULL with its exception set. */
static PyObject *call_in_context(HandleObject *h, PyObject *cb, PyObject *args, PyObject *ctx) {
    if (ctx && PyContext_Enter(ctx) < 0) return NULL;
    PyObject *res = h->is_timeout ? ext_timeout_fire(cb) : PyObject_Call(cb, args, NULL);
    if (ctx) {
        PyObject *exc = res ? NULL : PyErr_GetRaisedException();
        PyContext_Exit(ctx);
        if (exc) PyErr_SetRaisedException(exc);
    }
    return res;
}

/* The callback raised (the current exception): on_error(handle, exc), or
 * sys.unraisablehook.  -1 with the exception set if it must propagate. */
static int report(HandleObject *h, PyObject *on_error, PyObject *cb, PyObject *args) {
    if (is_exit()) return -1; /* out of the loop, as asyncio lets them */
    PyObject *exc = PyErr_GetRaisedException();
    int rc = 0;
    /* The handle shows its callback while being reported. */
    Py_XSETREF(h->callback, Py_NewRef(cb));
    Py_XSETREF(h->args, Py_NewRef(args));
    if (on_error && on_error != Py_None) {
        PyObject *r = PyObject_CallFunctionObjArgs(on_error, (PyObject *)h, exc, NULL);
        if (r) Py_DECREF(r);
        else if (is_exit()) rc = -1;
        else PyErr_WriteUnraisable(on_error);
    } else {
        PyErr_SetRaisedException(Py_NewRef(exc));
        PyErr_WriteUnraisable(cb);
    }
    Py_DECREF(exc);
    Py_CLEAR(h->callback);
    Py_CLEAR(h->args);
    return rc;
}

int ext_handle_run(HandleObject *h, PyObject *on_error, int drop) {
    PyObject *cb = h->callback, *args = h->args, *ctx = h->context;
    h->callback = h->args = h->context = NULL;
    atomic_store_explicit(&h->state, drop ? H_DROPPED : H_RAN, memory_order_release);
    int rc = 0;
    if (!drop && cb) {
        PyObject *res = call_in_context(h, cb, args, ctx);
        if (res) Py_DECREF(res);
        else rc = report(h, on_error, cb, args);
    }
    Py_XDECREF(cb);
    Py_XDECREF(args);
    Py_XDECREF(ctx);
    return rc;
}

int ext_handle_postpone(HandleObject *h, double when) {
    if (!h->tt || bt_postpone(h->tt->core, h->id, bt_deadline_at(when)) != BT_POSTPONED) return 0;
    h->when = when;
    Py_CLEAR(h->when_obj);
    return 1;
}

void ext_drop_handle(void *ctx, bt_port *port, void *payload) {
    (void)ctx;
    if (!port || !payload) return;
    HandleObject *h = (HandleObject *)payload;
    atomic_store(&h->state, H_DROPPED);
    ext_handle_unhold(h);
    ext_handle_release_callback(h);
    Py_DECREF(h);
}
