# One image for every StageServe service; the command picks the stage.
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY stageserve ./stageserve
COPY services ./services
RUN pip install --no-cache-dir .
ENTRYPOINT ["stageserve"]
CMD ["--help"]
