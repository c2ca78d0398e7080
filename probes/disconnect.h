/* The one event record of the disconnect probe, shared by disconnect.bpf.c and the Python loader
 * (bcc derives the user-space layout from this struct, so there is no second definition). */
#ifndef AUDITOR_DISCONNECT_H
#define AUDITOR_DISCONNECT_H

/* What happened to a server-side socket; the numbers are part of the kernel/user contract. */
#define EVENT_PEER_FIN 1  /* ESTABLISHED -> CLOSE_WAIT: the client sent FIN */
#define EVENT_PEER_RST 2  /* tcp_receive_reset: the client sent RST */
#define EVENT_LOCAL_FIN 3 /* ESTABLISHED -> FIN_WAIT1: the server closed first */
#define EVENT_CLOSED 4    /* the socket reached CLOSE */

struct event {
    u64 ts_ns;       /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
    u64 skaddr;      /* the kernel socket address: identity while the socket lives */
    u8 saddr[16];    /* server (local) address: 4 bytes for AF_INET, 16 for AF_INET6 */
    u8 daddr[16];    /* client (remote) address */
    u16 sport;       /* server (local) port, host byte order */
    u16 dport;       /* client (remote) port, host byte order */
    u16 family;      /* AF_INET or AF_INET6 */
    u8 kind;         /* EVENT_* */
    u8 oldstate;     /* TCP state before the change (0 for resets: the tracepoint has none) */
};

#endif
