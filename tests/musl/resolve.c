/*
 * resolve NAME: prints NAME's first IPv4 address as musl's resolver finds
 * it (getaddrinfo, reading /etc/resolv.conf), or the resolver's error.
 * Built static against Debian's musl (musl-tools) by tests/build.rs: this
 * is how a program in an Alpine container resolves. Its queries go out
 * with sendto() on an unconnected UDP socket, and it accepts an answer
 * only from the address it asked.
 */
#include <arpa/inet.h>
#include <netdb.h>
#include <stdio.h>
#include <sys/socket.h>

int main(int argc, char **argv)
{
	struct addrinfo hints = { .ai_family = AF_INET, .ai_socktype = SOCK_DGRAM };
	struct addrinfo *found;
	char text[INET_ADDRSTRLEN];
	int rc;

	if (argc != 2) {
		fprintf(stderr, "usage: resolve NAME\n");
		return 2;
	}
	rc = getaddrinfo(argv[1], NULL, &hints, &found);
	if (rc != 0) {
		fprintf(stderr, "%s: %s\n", argv[1], gai_strerror(rc));
		return 1;
	}
	inet_ntop(AF_INET, &((struct sockaddr_in *)found->ai_addr)->sin_addr, text, sizeof text);
	printf("%s\n", text);
	freeaddrinfo(found);
	return 0;
}
