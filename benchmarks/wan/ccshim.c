/* LD_PRELOAD shim: every TCP socket the process opens uses the congestion control named
 * by $WAN_CC (e.g. cubic). The benchmark's namespaces accept only reno or bbr as their
 * default, and most real hosts run cubic; gRPC and Flower create their sockets in C or
 * in libraries we do not control, so the choice is made at socket(). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

int socket(int domain, int type, int protocol) {
  static int (*real_socket)(int, int, int);
  if (!real_socket) real_socket = (int (*)(int, int, int))dlsym(RTLD_NEXT, "socket");
  int fd = real_socket(domain, type, protocol);
  const char *cc = getenv("WAN_CC");
  if (fd >= 0 && cc && *cc && (domain == AF_INET || domain == AF_INET6) &&
      (type & 0xf) == SOCK_STREAM)
    setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc, (socklen_t)strlen(cc));
  return fd;
}
