/*
 * scheduler_type.c -- the drop-in loop's call_at/call_later: a callable bound to
 * (TimerThread, loop), set on the loop instance (loop.py), so that
 * loop.call_later(d, cb) is one vectorcall into schedule.c.  Its handles
 * are LoopHandles, with asyncio.TimerHandle's semantics (cancel() returns None).  A
 * Scheduler never changes once made; it is called with the GIL held.
 */
#include "module.h"

/* ---- Scheduler: loop.call_at / loop.call_later of the drop-in loop --------
 * A callable bound to (TimerThread, loop) so the drop-in loop's call_later
 * is one vectorcall, with asyncio.TimerHandle semantics on its handles. */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    TimerThreadObject *tt;
    PyObject *loop;
    int absolute;
} SchedulerObject;
#define SCHEDULER_REFS(X) X(tt) X(loop)

static PyObject *Scheduler_vectorcall(SchedulerObject *self, PyObject *const *args, size_t nargsf,
                                      PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *context = NULL;
    if (ext_parse_schedule_args(args, nargs, kwnames, self->absolute, NULL, &context) < 0)
        return NULL;
    if (ext_check_open(self->tt) < 0) return NULL;
    double t;
    if (ext_to_seconds(args[0], self->absolute ? "when" : "delay", &t) < 0) return NULL;
    PyObject *h = ext_schedule(self->tt, self->absolute, t, args[1], args + 2, nargs - 2,
                               self->loop, context, EXT_SCHED_COMPAT);
    if (h && self->absolute) ext_handle_keep_when(h, args[0]);
    return h;
}

EXT_GC_TRAVERSE(Scheduler, SchedulerObject, SCHEDULER_REFS)
EXT_GC_CLEAR(Scheduler, SchedulerObject, SCHEDULER_REFS)

static void Scheduler_dealloc(SchedulerObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Scheduler_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMemberDef Scheduler_members[] = {
    {"__vectorcalloffset__", Py_T_PYSSIZET, offsetof(SchedulerObject, vectorcall), Py_READONLY, NULL},
    {NULL}};

static PyType_Slot Scheduler_slots[] = {
    {Py_tp_doc, "loop.call_at / loop.call_later of the drop-in loop (asyncio handle semantics)."},
    {Py_tp_dealloc, Scheduler_dealloc},
    {Py_tp_traverse, Scheduler_traverse},
    {Py_tp_clear, Scheduler_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_members, Scheduler_members},
    {0, NULL}};

PyType_Spec Scheduler_spec = {
    .name = "bucketimer._core.Scheduler",
    .basicsize = sizeof(SchedulerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_HAVE_VECTORCALL,
    .slots = Scheduler_slots,
};

/* TimerThread._scheduler(loop, absolute) */
PyObject *ext_TimerThread_scheduler(TimerThreadObject *self, PyObject *args) {
    PyObject *loop;
    int absolute;
    if (!PyArg_ParseTuple(args, "Op:_scheduler", &loop, &absolute)) return NULL;
    if (!self->st) return ext_raise_errno(-EINVAL, "_scheduler");
    SchedulerObject *o = PyObject_GC_New(SchedulerObject, self->st->Scheduler_Type);
    if (!o) return NULL;
    o->vectorcall = (vectorcallfunc)Scheduler_vectorcall;
    o->tt = (TimerThreadObject *)Py_NewRef(self);
    o->loop = Py_NewRef(loop);
    o->absolute = absolute;
    PyObject_GC_Track(o);
    return (PyObject *)o;
}
